"""Static checks of the documentation sources, run by docs/build.sh before Sphinx.

1. Every public name (``pathspace_jax.__all__``) is documented by an autodoc directive in api.md.
2. Every Python example in the pages is executed by the doctest builder: Python may only appear in
   ``{doctest}``, ``{testcode}``/``{testoutput}`` or ``{testsetup}`` blocks, never in a plain
   ``python`` fence or code-block (shell commands in ``bash`` fences are allowed).
3. The figures the pages use exist (docs/make_figures.py writes them).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pathspace_jax

DOCS = Path(__file__).parent
ALLOWED_FENCES = {"doctest", "testcode", "testoutput", "testsetup", "testcleanup", "eval-rst", "toctree", "figure"}
ALLOWED_LANGUAGES = {"bash", "sh", "text", "console"}


def main() -> int:
    errors = []
    api = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^\.\. auto(?:function|class|exception|module):: ([\w.]+)", api, re.M))
    for name in pathspace_jax.__all__:
        if name not in documented and f"pathspace_jax.{name}" not in documented:
            errors.append(f"api.md: {name} (in pathspace_jax.__all__) has no autodoc entry")
    for page in sorted(DOCS.glob("*.md")):
        if page.name == "README.md":
            continue
        for lineno, line in enumerate(page.read_text().splitlines(), 1):
            m = re.match(r"^(`{3,}|:{3,})\s*(\{([\w-]+)\})?\s*([\w+-]*)", line)
            if not m or not (m.group(2) or m.group(4)):
                continue
            directive, language = m.group(3), m.group(4)
            if directive in ("code-block", "code", "sourcecode"):
                language = language or "python"
                directive = None
            if directive is not None and directive not in ALLOWED_FENCES:
                errors.append(f"{page.name}:{lineno}: {{{directive}}} block: not executed by the doctest step")
            elif directive is None and language not in ALLOWED_LANGUAGES:
                errors.append(f"{page.name}:{lineno}: a ```{language} block is not executed: use {{doctest}}")
        for image in re.findall(r"_static/[\w.-]+\.png", page.read_text()):
            if not (DOCS / image).exists():
                errors.append(f"{page.name}: {image} is missing (python docs/make_figures.py)")
    for e in errors:
        print(e, file=sys.stderr)
    print(f"check_docs: {len(pathspace_jax.__all__)} public names, {'ok' if not errors else 'FAILED'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
