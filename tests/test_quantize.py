"""The quantize stage (lowering.quantize): recipes, static int8, int8-dynamic and 8da4w."""

from __future__ import annotations

import json

import pytest

from lowering.errors import LoweringError
from lowering.quantize import RECIPE_NAMES, QuantizeError, QuantRecipe, parse_recipe


# ---------------------------------------------------------------- recipes


def test_recipe_names_and_defaults():
    assert RECIPE_NAMES == ("int8", "int8-dynamic", "8da4w")
    assert issubclass(QuantizeError, LoweringError)
    r = parse_recipe("8da4w")
    assert r == QuantRecipe("8da4w", group_size=32, keep_fp32=())
    assert parse_recipe("int8").needs_calibration
    assert not parse_recipe("int8-dynamic").needs_calibration
    assert not parse_recipe("8da4w").needs_calibration
    assert parse_recipe(r) is r


def test_recipe_from_mapping():
    r = parse_recipe({"recipe": "8da4w", "group_size": 64, "keep_fp32": ["lm_head", "LayerNorm"]})
    assert r == QuantRecipe("8da4w", 64, ("lm_head", "LayerNorm"))
    assert parse_recipe({"recipe": "int8", "keep_fp32": "fc1"}).keep_fp32 == ("fc1",)
    assert parse_recipe(r.to_dict()) == r
    assert parse_recipe(QuantRecipe("int8", keep_fp32=("a",)).to_dict()) == QuantRecipe("int8", keep_fp32=("a",))


def test_recipe_key_text_is_stable():
    # Pinned: the quantize stage's cache keys are built from these strings.
    assert parse_recipe("int8").key_text() == '{"keep_fp32":[],"recipe":"int8"}'
    assert parse_recipe("int8-dynamic").key_text() == '{"keep_fp32":[],"recipe":"int8-dynamic"}'
    assert parse_recipe("8da4w").key_text() == '{"group_size":32,"keep_fp32":[],"recipe":"8da4w"}'
    r = parse_recipe({"recipe": "8da4w", "group_size": 128, "keep_fp32": ["lm_head", "attn", "lm_head"]})
    assert r.key_text() == '{"group_size":128,"keep_fp32":["attn","lm_head"],"recipe":"8da4w"}'
    # the order of keep_fp32 does not decide the output, so not the key either
    assert r.key_text() == parse_recipe({"recipe": "8da4w", "group_size": 128,
                                         "keep_fp32": ["attn", "lm_head"]}).key_text()
    # a group size is meaningless for int8: it is not in the key
    assert QuantRecipe("int8", group_size=64).key_text() == parse_recipe("int8").key_text()
    assert json.loads(r.key_text())["recipe"] == "8da4w"
    assert hash(r) == hash(QuantRecipe("8da4w", 128, ("lm_head", "attn", "lm_head")))


@pytest.mark.parametrize(
    "spec, words",
    [
        ("int4", ["'int4'", "did you mean 'int8'"]),
        ("8da4", ["'8da4'", "did you mean '8da4w'"]),
        ("int8_dynamic", ["did you mean 'int8-dynamic'"]),
        ("fp16", ["'fp16'", "int8, int8-dynamic, 8da4w"]),
        (8, ["expected a recipe name", "int"]),
        (None, ["expected a recipe name", "NoneType"]),
        ({"name": "int8"}, ["unknown key", "'name'"]),
        ({"recipe": "8da4w", "groupsize": 64}, ["did you mean 'group_size'"]),
        ({"group_size": 64}, ["missing 'recipe'"]),
        ({"recipe": "8da4w", "group_size": 48}, ["group_size 48", "multiple of 32"]),
        ({"recipe": "8da4w", "group_size": 0}, ["multiple of 32"]),
        ({"recipe": "8da4w", "group_size": "32"}, ["group_size must be an int"]),
        ({"recipe": "8da4w", "group_size": True}, ["group_size must be an int"]),
        ({"recipe": "int8", "group_size": 64}, ["applies to 8da4w only"]),
        ({"recipe": "int8", "keep_fp32": 3}, ["keep_fp32 must be a list"]),
        ({"recipe": "int8", "keep_fp32": ["fc", ""]}, ["non-empty strings"]),
        ({"recipe": 8}, ["'recipe' must be a string"]),
    ],
)
def test_bad_recipe_names_the_input(spec, words):
    with pytest.raises(QuantizeError) as info:
        parse_recipe(spec)
    for word in words:
        assert word in str(info.value)


def test_recipe_is_frozen():
    r = parse_recipe("int8")
    with pytest.raises(Exception):
        r.name = "8da4w"
    assert str(parse_recipe({"recipe": "8da4w", "group_size": 64, "keep_fp32": ["x"]})) == \
        "8da4w, group_size=64, keep_fp32=['x']"
