"""The tracer's results against golden fingerprints recorded from an earlier version of the code
(`tests/golden/record.py`, which says what is recorded): for every model of the zoo, the Flax examples and the
trace benchmark, the space's fingerprint, H, `describe`'s texts and the hashes of the flat programs exactly, the
numbers (path norm, κ, DDP's κ, one step of each optimiser) to 1e-6 in float64 and 1e-5 in float32, and every
exception's message exactly.

A check that a rewrite changes no behaviour. The golden file is per JAX version (``tests/golden/jax-<version>.json``
or ``.json.gz``); where none exists for the running JAX the tests are skipped. After an intended change of behaviour
record it again, from the repository root::

    python tests/golden/record.py tests/golden/jax-$(python -c "import jax; print(jax.__version__)").json

One test per model; each records its model once (the module's `recorded` fixture), in a few seconds.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import jax
import pytest

_spec = importlib.util.spec_from_file_location("golden_record", Path(__file__).parent / "golden" / "record.py")
golden = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = golden  # (dataclasses look their module up)
_spec.loader.exec_module(golden)

PATH = golden.golden_path()
GOLDEN = golden.load(PATH)["models"] if PATH is not None else {}
NO_GOLDEN = (
    f"no golden file for JAX {jax.__version__} (tests/golden/jax-{jax.__version__}.json[.gz]; there are "
    f"{sorted(p.name for p in (Path(__file__).parent / 'golden').glob('jax-*.json*'))}): record one with "
    f"`python tests/golden/record.py tests/golden/jax-{jax.__version__}.json` on code known to be right"
)


class _Recorded(dict):
    """Each model's record, made on first use."""

    def __init__(self):
        super().__init__()
        self.models = golden.models()

    def __repr__(self) -> str:  # (not every record in a failure's report)
        return f"<records of {len(self)} models>"

    def __missing__(self, name: str) -> dict:
        self[name] = golden.record(self.models[name])
        return self[name]


@pytest.fixture(scope="module")
def recorded():
    if PATH is None:
        pytest.skip(NO_GOLDEN)
    return _Recorded()


@pytest.mark.slow
def test_golden_covers_every_model(recorded):
    """The golden file has every model that the recorder knows, and no other."""
    missing, extra = sorted(set(recorded.models) - set(GOLDEN)), sorted(set(GOLDEN) - set(recorded.models))
    assert not missing and not extra, f"{PATH.name}: models not recorded there {missing}; no longer built {extra}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GOLDEN) or [pytest.param("none", marks=pytest.mark.skip(reason=NO_GOLDEN))])
def test_golden(recorded, name):
    """The model's record now is its golden one: every field that differs is listed."""
    if name not in recorded.models:
        pytest.fail(f"{name}: in {PATH.name} but no longer built by tests/golden/record.py")
    diffs = golden.compare(GOLDEN[name], recorded[name])
    fields = sorted({re.match(r"[^:\[]*", d).group() for d in diffs})
    assert not diffs, f"{name} differs from {PATH.name} in {', '.join(fields)}:\n  " + "\n  ".join(diffs)
