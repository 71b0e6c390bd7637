"""tests/README.md names the test that checks each refusal: every name it gives is a test that exists."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: the shorthand the README uses for the bad-input tests
SHORTHAND = {"T": "tests/test_bad_input.py"}


def references(text: str) -> list[tuple[str, str]]:
    """``(file, test)`` for each ``file::test``, ``T::test`` and ``::test`` (the file named last in
    the same cell) in ``text``."""
    out = []
    for line in text.splitlines():
        for cell in line.split("|"):
            current = None
            for match in re.finditer(r"`((?:tests/[\w/]+\.py)|T)?::(\w+)", cell):
                file, test = match.groups()
                current = SHORTHAND.get(file, file) if file else current
                if current is not None:
                    out.append((current, test))
    return out


def missing(refs: list[tuple[str, str]]) -> list[str]:
    """``file::test`` for each reference whose file defines no such test function, sorted."""
    return sorted(
        {
            f"{file}::{test}"
            for file, test in refs
            if not re.search(rf"^(async )?def {test}\(", (TESTS.parent / file).read_text(encoding="utf-8"), re.M)
        }
    )


def test_every_test_the_readme_names_exists():
    refs = references((TESTS / "README.md").read_text(encoding="utf-8"))
    assert len(refs) > 100  # the table is read, not skipped
    assert missing(refs) == []


def test_a_stale_name_is_caught():
    refs = references("| x | `tests/test_sweep.py::nope`, `::also_nope` | `T::gone` |")
    assert refs == [
        ("tests/test_sweep.py", "nope"),
        ("tests/test_sweep.py", "also_nope"),
        ("tests/test_bad_input.py", "gone"),
    ]
    assert missing(refs) == [
        "tests/test_bad_input.py::gone",
        "tests/test_sweep.py::also_nope",
        "tests/test_sweep.py::nope",
    ]
    assert missing([("tests/test_readme_references.py", "test_a_stale_name_is_caught")]) == []
