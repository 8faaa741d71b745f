"""The references kept as data (tests/data/refs/, `make refs`) still come out of the script
that made them, so they cannot rot: the cheapest one is rebuilt here and compared whole; every
file says which versions made it; a missing file is a named error that says how to make it."""
import json

import pytest

from tests import refs
from tests.refs import make

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")


def test_the_script_reproduces_the_committed_tokenizer_reference():
    kept = refs.load("smollm2-tokenizer")
    again = json.loads(json.dumps(make.BUILDERS["smollm2-tokenizer"]()))  # as it is written: tuples become lists
    assert {k: v for k, v in kept.items() if k != "versions"} == again


def test_every_reference_names_the_versions_that_made_it():
    for name in make.BUILDERS:
        kept = refs.load(name)
        assert {"python", "torch", "transformers"} <= kept["versions"].keys(), name


def test_a_missing_reference_says_how_to_make_it():
    with pytest.raises(refs.MissingReference, match="make refs"):
        refs.load("no-such-reference")


def test_the_script_refuses_an_unknown_name(capsys):
    assert make.main(["no-such-reference"]) == 2
    assert "smollm2-tokenizer" in capsys.readouterr().err
