"""Smoke tests of the examples: each runs in its ``--quick`` mode and its result says what it claims."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the example's Flax modules (dataclasses) look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_unbalanced_quick(tmp_path):
    results = _load("unbalanced").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "unbalanced.png").stat().st_size > 0 and (tmp_path / "unbalanced.json").exists()
    # the rescaled copies are different starting points for SGD and Adam...
    assert results["SGD"]["spread"] > 1.0 and results["Adam"]["spread"] > 0.1
    # ...and the same one for the path-space optimisers, up to float64 rounding
    for name in ["Path-SGD", "DDP-SGD (α=0.5)", "G-SGD", "G-Adam"]:
        assert results[name]["spread"] < 1e-6, (name, results[name]["spread"])
        assert np.all(np.isfinite(results[name]["loss"]))


class _Stop(Exception):
    pass


@pytest.mark.slow
def test_sequential_digits_quick(tmp_path, monkeypatch):
    module = _load("sequential_digits")
    trained, train, stop_at = [], module.train, [2]

    def counted(*args, **kwargs):  # the first run stops during its third optimiser
        if len(trained) == stop_at[0]:
            raise _Stop
        trained.append(train(*args, **kwargs))
        return trained[-1]

    monkeypatch.setattr(module, "train", counted)
    with pytest.raises(_Stop):
        module.main(["--quick", "--out", str(tmp_path)])
    saved = {f.stem: json.loads(f.read_text())["run"] for f in (tmp_path / "sequential_digits_runs").glob("*.json")}
    assert set(saved) == {"rows_SGD", "rows_Path-SGD"}
    stop_at[0] = None
    results = module.main(["--quick", "--out", str(tmp_path)])  # the same command again resumes it
    assert len(trained) == 6  # the two saved optimisers were not trained again
    assert not (tmp_path / "sequential_digits_runs").exists()  # removed once the run is complete
    assert (tmp_path / "sequential_digits.png").stat().st_size > 0 and (tmp_path / "sequential_digits.json").exists()
    runs = results["rows"]
    assert {f"rows_{name}": runs[name] for name in ("SGD", "Path-SGD")} == saved
    assert set(runs) == {"SGD", "Path-SGD", "G-SGD", "DDP-SGD", "Adam", "G-Adam"}
    for name, run in runs.items():
        assert np.all(np.isfinite(run["loss"])), name
        # a few epochs on the rows task already leave chance (90% error) far behind
        assert np.mean(run["test_error"]) < 0.6, (name, run["test_error"])
        # the training loss falls from its first epoch to its last
        assert np.all(np.asarray(run["loss"])[-1] < np.asarray(run["loss"])[0]), name


def test_quickstart_nnx_runs(capsys):
    _load("quickstart_nnx").main([])  # (not pytest's own arguments in sys.argv)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10
    assert float(lines[-1].rsplit(" ", 1)[-1]) > 0.9  # test accuracy after 10 epochs of G-Adam


@pytest.mark.slow
def test_char_lm_quick(tmp_path):
    results = _load("char_lm").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "char_lm.png").stat().st_size > 0 and (tmp_path / "char_lm.json").exists()
    assert set(results) == {"SGD", "Path-SGD", "G-SGD", "Adam", "G-Adam"}
    for name, r in results.items():
        assert np.all(np.isfinite(r["loss"])), name
        # below a uniform guess over the 103 characters (6.7 bits) after 60 steps
        assert r["held_out_bpc"][-1] < 6.0, (name, r["held_out_bpc"])


@pytest.mark.slow
def test_adding_problem_quick(tmp_path):
    results = _load("adding_problem").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "adding_problem.png").stat().st_size > 0 and (tmp_path / "adding_problem.json").exists()
    runs = results[20]
    assert set(runs) == {"SGD", "Path-SGD κ⁽¹⁾", "Path-SGD κ⁽¹⁾+κ⁽²⁾", "G-SGD", "Adam", "G-Adam"}
    for name, r in runs.items():
        # from an output near 0 (error ≈ 1.2) to below 0.5 in 150 steps; the task is solved below 1/6 ≈ 0.167
        assert np.all(np.isfinite(r["test_mse"])) and np.max(r["test_mse"]) < 0.5, (name, r["test_mse"])


@pytest.mark.slow
def test_adding_problem_paper_budget_stops_and_resumes_bit_for_bit(tmp_path, capsys):
    """The paper budget's machinery at a tiny size: a run stopped by --hours after its first chunk, then resumed
    from its checkpoints, ends exactly where an uninterrupted run does (found rates and every curve)."""
    mod = _load("adding_problem")
    tiny = ["--budget", "paper", "--lengths", "10", "--hidden", "8", "--seeds", "2", "--steps", "100", "--evals", "2",
            "--only", "SGD"]  # fmt: skip
    whole = mod.main([*tiny, "--out", str(tmp_path / "whole")])[10]["SGD"]
    assert mod.main([*tiny, "--out", str(tmp_path / "cut"), "--hours", "1e-9"]) is None
    mod.main([*tiny, "--out", str(tmp_path / "cut"), "--status"])
    assert "T10_SGD_pilot: 1/4 chunks" in capsys.readouterr().out
    cut = mod.main([*tiny, "--out", str(tmp_path / "cut")])[10]["SGD"]
    assert cut["lrs"] == whole["lrs"] and len(cut["lrs"]) >= 5
    assert cut["val"] == whole["val"] and cut["test"] == whole["test"]
    # the per-rate table: every trained rate, its mean final test error and seeds below 0.05, or "diverged"
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()}
    val, test = np.asarray(cut["val"])[-1], np.asarray(cut["test"])[-1]  # (seeds, rates)
    for j, lr in enumerate(cut["lrs"]):
        if np.any(~np.isfinite(val[:, j]) | (val[:, j] > 2)):
            assert rows[f"{lr:g}"] == ["diverged"], (lr, rows[f"{lr:g}"])
        else:
            assert rows[f"{lr:g}"] == [f"{test[:, j].mean():.3f}", f"{np.sum(test[:, j] < 0.05)}/2"], lr


@pytest.mark.slow
def test_digits_mlp_cnn_quick(tmp_path):
    results = _load("digits_mlp_cnn").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "digits_mlp_cnn.png").stat().st_size > 0 and (tmp_path / "digits_mlp_cnn.json").exists()
    runs = results["MLP"]
    assert len(runs) == 12 and {"BatchNorm", "DDP-SGD α=0.5", "DDP-Norm α=0.5"} <= set(runs)
    for name, r in runs.items():
        assert np.all(np.isfinite(r["loss"])), name
        assert np.mean(r["test_error"]) < 0.5, (name, r["test_error"])  # chance is 90%
    # DDP-SGD at α = 0 is Path-SGD (its κ is the path-norm κ): the same steps, up to rounding
    np.testing.assert_allclose(runs["DDP-SGD α=0"]["loss"], runs["Path-SGD"]["loss"], rtol=1e-4)


@pytest.mark.slow
def test_multiprocess_quick(tmp_path):
    """Two processes joined by jax.distributed, a (data, model) mesh of 2 x 2 CPU devices: every optimiser's params
    after 3 steps equal the one-device run's up to float32 rounding."""
    import jax

    if "jax_cpu_collectives_implementation" not in jax.config.values:
        pytest.skip(f"JAX {jax.__version__} has no CPU collectives (jax_cpu_collectives_implementation)")
    result = _load("multiprocess").main(["--quick", "--out", str(tmp_path)])
    diffs = result["max_relative_difference"]
    assert set(diffs) == {"SGD", "Adam", "G-SGD", "G-Adam", "Path-SGD", "DDP-SGD (α=1)"}
    for name, diff in diffs.items():  # Adam's steps divide by the root of tiny second moments: rounding shows more
        assert diff < (1e-4 if "Adam" in name else 1e-6), (name, diff)
