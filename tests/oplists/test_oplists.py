"""Op-list loading, validation and overrides."""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from helpers import Snapshot
from amp_patch import ListError
from amp_patch import oplists
from amp_patch.oplists import collect_problems, default_files, load


@pytest.mark.quick
def test_defaults_load_and_cover_every_namespace():
    table = load()
    namespaces = {e.namespace for e in table.entries}
    assert namespaces == {
        "torch", "torch.nn.functional", "torch.Tensor", "torch.linalg", "torch.special", "torch.fft", "torch._VF",
    }
    names = {e.qualname for e in table.entries}
    # what apex.amp missed, among others
    for op in [
        "torch.einsum", "torch.baddbmm", "torch.log1p", "torch.logsumexp", "torch.cdist", "torch.nn.functional.pdist",
        "torch.index_put", "torch.scatter_add", "torch.tensordot", "torch.vdot", "torch.linalg.vecdot",
        "torch.linalg.multi_dot", "torch.nn.functional.scaled_dot_product_attention", "torch.lstm_cell",
        "torch.Tensor.__matmul__", "torch.Tensor.__pow__", "torch.Tensor.__add__",
    ]:
        assert op in names, op


def test_default_files_are_shipped_as_package_data():
    names = [n for n, _ in default_files()]
    assert "torch.nn.functional.yaml" in names and "torch.Tensor.yaml" in names and "torch.fft.yaml" in names


@pytest.mark.parametrize(
    "override, fragment",
    [
        ({"torch.nn.functional": {"float": ["sofmax"]}}, "'sofmax' is not in torch.nn.functional; did you mean 'softmax'?"),
        ({"torch.nn.functionl": {"float": ["softmax"]}}, "'torch.nn.functionl' is not a known namespace; did you mean 'torch.nn.functional'?"),
        ({"torch": {"hlaf": ["mm"]}}, "torch.hlaf is not a policy; did you mean 'half'?"),
        ({"torch": {"half": "mm"}}, "torch.half must be a list of op names"),
        ({"torch": {"half": [{"name": "mm", "wen": {}}]}}, "unknown key 'wen'; did you mean 'when'?"),
        ({"torch": {"half": [{"name": "mm", "when": {"dtype": "float61"}}]}}, "'when.dtype' of 'mm' is 'float61'; did you mean 'float16'?"),
        ({"torch": {"half": ["mm", "mm"]}}, "'mm' is listed twice"),
        ({"torch": {"half": ["mm"], "float": ["mm"]}}, "is under two policies"),
        ({"torch": ["mm"]}, "torch must map policy names to lists of ops"),
        ([["mm"]], "lists= takes a YAML path, a dict, or a list of them; got list"),
    ],
)
def test_invalid_override_raises_naming_entry_and_fix(override, fragment):
    snapshot = Snapshot({"torch.nn.functional": F})
    with pytest.raises(ListError) as info:
        amp_patch.initialize(None, None, "O1", lists=override)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)
    assert not amp_patch.is_initialized()
    assert snapshot.changed() == []


@pytest.mark.quick
def test_file_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "lists.yaml"
    bad.write_text("torch.nn.functional:\n  float:\n    - linear\n    - sofmax\n")
    with pytest.raises(ListError, match=r"lists.yaml:4: torch.nn.functional.float\[1\] 'sofmax' .*did you mean 'softmax'"):
        load(str(bad))


def test_every_problem_is_reported_at_once(tmp_path):
    bad = tmp_path / "many.yaml"
    bad.write_text("torch:\n  half: [mmm, bmmm]\n")
    problems, _ = collect_problems([str(bad)])
    assert len(problems) == 2 and "did you mean 'mm'" in problems[0] and "did you mean 'bmm'" in problems[1]


def test_top_level_list_is_refused(tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- mm\n- bmm\n")
    with pytest.raises(ListError, match="must be a mapping of namespaces"):
        load(str(bad))


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("torch:\n  half: [mm, bmm\n  float: [exp]\n")
    with pytest.raises(ListError, match=r"broken.yaml:\d+: malformed YAML"):
        load(str(bad))


def test_missing_file_symlink_encoding_and_size(tmp_path):
    with pytest.raises(ListError, match="no such op-list file"):
        load(str(tmp_path / "nope.yaml"))
    link = tmp_path / "dangling.yaml"
    os.symlink(tmp_path / "gone.yaml", link)
    with pytest.raises(ListError, match="symbolic link to .*gone.yaml.*does not exist"):
        load(str(link))
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("torch:\n  half: [mm]  # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ListError, match="is not UTF-8"):
        load(str(latin))
    huge = tmp_path / "huge.yaml"
    huge.write_text("# " + "x" * (2 << 20))
    with pytest.raises(ListError, match="must be under"):
        load(str(huge))


def test_yaml_bomb_is_refused(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    lines = ["a: &a [mm, mm, mm, mm, mm, mm, mm, mm, mm]"]
    for i, name in enumerate("bcdefghij"):
        prev = "abcdefghij"[i]
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    lines.append("torch:\n  half: *j")
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(ListError, match="anchors and aliases are not allowed|not a known namespace"):
        load(str(bomb))


def test_yaml_tags_are_not_executed(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("torch:\n  half: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ListError, match=r"evil.yaml:2: YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed"):
        load(str(evil))


def test_remove_is_only_for_overrides_and_removes_everywhere():
    table = load({"torch": {"remove": ["mm"]}})
    assert not [e for e in table.entries if e.qualname == "torch.mm"]


@pytest.mark.quick
def test_override_moves_op_between_policies():
    table = load({"torch.nn.functional": {"float": ["linear"]}, "torch": {"half": ["cumsum"]}})
    resolved = table.resolve(torch.bfloat16)
    assert resolved[("torch.nn.functional", "linear")].policy == "float"
    assert resolved[("torch", "cumsum")].policy == "half"
    assert resolved[("torch", "cumsum")].source == "<lists dict>"


def test_env_var_overrides(tmp_path, monkeypatch):
    f = tmp_path / "env.yaml"
    f.write_text("torch.nn.functional:\n  float: [linear]\n")
    monkeypatch.setenv("AMP_PATCH_LISTS", str(f))
    resolved = load().resolve(torch.float16)
    assert resolved[("torch.nn.functional", "linear")].policy == "float"
    assert resolved[("torch.nn.functional", "linear")].source.startswith(str(f))


@pytest.mark.quick
def test_conditions_pick_policy_by_dtype():
    table = load()
    fp16 = table.resolve(torch.float16)
    bf16 = table.resolve(torch.bfloat16)
    assert fp16[("torch.nn.functional", "softmax")].policy == "float"
    assert ("torch.nn.functional", "softmax") not in bf16  # BF16 kernels accumulate in FP32
    assert fp16[("torch.nn.functional", "binary_cross_entropy")].policy == "banned"
    assert bf16[("torch.nn.functional", "binary_cross_entropy")].policy == "float"


def test_conditions_pick_policy_by_dtype_and_device():
    # grid_sample follows each autocast: FP32 on CPU (BF16), promote on CUDA (either dtype).
    table = load()
    key = ("torch.nn.functional", "grid_sample")
    assert table.resolve(torch.bfloat16, "cpu")[key].policy == "float"
    assert table.resolve(torch.bfloat16, "cuda")[key].policy == "promote"
    assert table.resolve(torch.float16, "cpu")[key].policy == "promote"
    assert table.resolve(torch.float16, "cuda")[key].policy == "promote"


def test_optional_missing_op_is_logged_not_silent(caplog):
    import logging

    caplog.set_level(logging.DEBUG, logger="amp_patch")
    table = load({"torch": {"half": [{"name": "no_such_op_in_this_torch", "optional": True}]}})
    assert [e.name for e in table.missing()] == ["no_such_op_in_this_torch"]
    assert "no_such_op_in_this_torch" in caplog.text
    assert ("torch", "no_such_op_in_this_torch") not in table.resolve(torch.float16)


def test_inplace_forms_follow_their_op_unless_listed_or_removed():
    table = load()
    fp16, bf16 = table.resolve(torch.float16, "cuda"), table.resolve(torch.bfloat16, "cpu")
    exp, exp_ = fp16[("torch.Tensor", "exp")], fp16[("torch.Tensor", "exp_")]
    assert (exp_.policy, exp_.when, exp_.source, exp_.derived_from) == ("float", exp.when, exp.source, "exp")
    assert fp16[("torch.Tensor", "__ipow__")].derived_from == "__pow__"
    assert fp16[("torch", "exp_")].policy == "float"
    assert bf16[("torch.Tensor", "addmm_")].policy == "half"
    assert ("torch.Tensor", "exp_") not in bf16  # exp itself is FP32 only under FP16
    # listed in-place forms keep their own entry; reflected and in-place names have none
    assert fp16[("torch.Tensor", "__iadd__")].derived_from == ""
    assert not [e for e in table.entries if e.derived_from.startswith(("__r", "__i")) or e.derived_from.endswith("_")
                   and not e.derived_from.endswith("__")]
    moved = load({"torch.Tensor": {"half": ["exp"], "remove": ["log_"]}}).resolve(torch.float16)
    assert moved[("torch.Tensor", "exp_")].policy == "half"
    assert ("torch.Tensor", "log_") not in moved and moved[("torch.Tensor", "log")].policy == "float"
    gone = load({"torch.Tensor": {"remove": ["exp"]}}).resolve(torch.float16)
    assert ("torch.Tensor", "exp") not in gone and ("torch.Tensor", "exp_") not in gone
    relisted = load([{"torch.Tensor": {"remove": ["log_"]}}, {"torch.Tensor": {"promote": ["log_"]}}])
    assert relisted.resolve(torch.float16)[("torch.Tensor", "log_")].policy == "promote"


def test_every_problem_of_one_entry_is_reported():
    bad = {"torch": {"float": [{"name": "cumsun", "when": {"device": "tpu", "dtyp": "float16"}, "bogus_key": 1}]}}
    problems, _ = collect_problems([bad])
    assert problems == [
        "<lists dict>: torch.float[0] has unknown key 'bogus_key' (valid: name, when, optional, why, fix)",
        "<lists dict>: torch.float[0] 'when.device' of 'cumsun' is 'tpu'; did you mean 'cpu'? (valid: cpu, cuda)",
        "<lists dict>: torch.float[0] 'when' of 'cumsun' has unknown key 'dtyp'; did you mean 'dtype'? (valid: dtype, device)",
        "<lists dict>: torch.float[0] 'cumsun' is not in torch; did you mean 'cumsum'? "
        "(mark it 'optional: true' if it exists only in some torch versions)",
    ]


# ------------------------------------------------------------------ only tensor ops can be listed


@pytest.mark.parametrize(
    "ns, name, why",
    [
        ("torch.Tensor", "__getattribute__", "is serialization, random state, configuration or the object protocol"),
        ("torch", "save", "is serialization"),
        ("torch", "load", "is serialization"),
        ("torch", "Tensor", "is a class"),
        ("torch", "no_grad", "is a class"),
        ("torch", "set_default_dtype", "is serialization, random state, configuration"),
        ("torch", "manual_seed", "is serialization, random state"),
    ],
)
def test_a_callable_that_is_no_tensor_op_is_refused_with_the_reason(ns, name, why):
    with pytest.raises(ListError, match=rf"{re.escape(ns)}\.{re.escape(name)} {re.escape(why)}.*only functions that compute on tensors"):
        oplists.load({ns: {"half": [name]}})


def test_register_refuses_what_is_no_tensor_op():
    for name in ("save", "Tensor"):
        with pytest.raises(amp_patch.ConfigError, match=rf"torch\.{name} is .*not a tensor op; register_half_function wraps"):
            amp_patch.register_half_function(torch, name)


def test_removing_needs_no_tensor_op_but_a_listed_name_and_shipped_lists_pass():
    oplists.load()  # every shipped entry is a tensor op
    oplists.load({"torch": {"remove": ["mm"]}})
    with pytest.raises(ListError, match=r"torch\.remove 'save' is on no list, so there is nothing to remove"):
        oplists.load({"torch": {"remove": ["save"]}})


def test_the_docs_override_example_loads_and_each_line_does_what_its_comment_says():
    import yaml

    from docs_text import docs_text

    block = next(b for b in re.findall(r"```yaml\n(.*?)```", docs_text(), re.S) if "remove:" in b)
    default = load()
    table = load(yaml.safe_load(block)).resolve(torch.float16, "cuda")
    before = default.resolve(torch.float16, "cuda")
    assert ("torch.nn.functional", "softmax") in before and ("torch.nn.functional", "softmax") not in table
    assert table[("torch.nn.functional", "linear")].policy == "float"
    assert table[("torch", "cumsum")].policy == "half"
