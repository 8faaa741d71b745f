"""`make refs`: compute the references the tests compare to and write them to tests/data/refs/.

    python -m tests.refs.make            # every reference (a few minutes: transformers loads both models)
    python -m tests.refs.make NAME ...   # only these (smollm2-tokenizer, smollm2, gemma3)
"""
from __future__ import annotations

import sys

from tests.refs import dump, gemma3, smollm2

BUILDERS = {"smollm2-tokenizer": smollm2.tokenizer, "smollm2": smollm2.model, "gemma3": gemma3.build}


def main(argv: list[str]) -> int:
    names = argv or list(BUILDERS)
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        print(f"unknown references {unknown}; known: {', '.join(BUILDERS)}", file=sys.stderr)
        return 2
    for name in names:
        print(f"wrote {dump(name, BUILDERS[name]())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
