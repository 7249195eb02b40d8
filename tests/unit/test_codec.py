"""Unit tests for preempt.checkpoint.codec: nested state <-> (JSON, tensors), without pickle."""

from __future__ import annotations

import collections
import json
import math
from typing import Any

import numpy as np
import pytest
import torch

from preempt.checkpoint import codec
from preempt.errors import PreemptError, UnsupportedStateError


def roundtrip(tree: Any, prefix: str = "") -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """Encodes, passes the JSON part through real JSON text, decodes. Returns (decoded, encoded, tensors)."""
    tensors: dict[str, torch.Tensor] = {}
    enc = codec.encode(tree, prefix, tensors)
    text = codec.dumps(enc)  # the JSON part must be plain JSON, as the checkpoint writes it
    dec = codec.decode(json.loads(text), tensors, "state.json")
    return dec, enc, tensors


def assert_same(a: Any, b: Any, path: str = "root") -> None:
    """Deep equality that also checks container types (tuple vs list) and tensor dtype/shape/bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        np.testing.assert_array_equal(a, b)
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), path
        # Key order is checked separately (test_plain_dict_key_order_survives_json); only
        # dicts with non-string keys (stored as a list of pairs) must keep it here.
        if all(isinstance(k, str) for k in a):
            assert sorted(a) == sorted(b), path
        else:
            assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert type(k) is type(next(x for x in b if x == k)), f"{path}: key {k!r}"
            assert_same(a[k], b[k], f"{path}[{k!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def _adamw_state() -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.85, 0.995), weight_decay=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    return model, opt


def test_adamw_state_dict_round_trip():
    """A real AdamW state_dict round-trips: int keys in 'state', tuple betas, tensors and all scalars."""
    _, opt = _adamw_state()
    sd = opt.state_dict()
    dec, enc, tensors = roundtrip(sd, "optimizer")
    assert set(dec["state"]) == {0, 1, 2, 3}
    assert all(type(k) is int for k in dec["state"])
    assert dec["param_groups"][0]["betas"] == (0.85, 0.995)
    assert type(dec["param_groups"][0]["betas"]) is tuple
    assert_same(sd, dec)
    assert all(k.startswith("optimizer.") for k in tensors)
    assert len(tensors) == 12  # step, exp_avg, exp_avg_sq for 4 parameters

    # The decoded dict is what load_state_dict accepts, and it restores the same state.
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt2 = torch.optim.AdamW(model2.parameters())
    opt2.load_state_dict(dec)
    assert_same(opt2.state_dict(), sd)


def test_module_state_dict_round_trip():
    """An OrderedDict state_dict of a module decodes to equal tensors under the same keys."""
    model, _ = _adamw_state()
    sd = model.state_dict()
    dec, _, tensors = roundtrip(sd, "model")
    assert dec.keys() == sd.keys()
    for k in sd:
        assert torch.equal(dec[k], sd[k])
    assert set(tensors) == {f"model.{k}" for k in sd}


def test_nested_lists_and_tuples_keep_their_types():
    tree = {
        "a": [1, (2, [3, (4,)]), (), []],
        "b": ((),),
        "c": ([], ("x", None, True, 1.5)),
        "t": (torch.arange(3), [torch.ones(2, 2)]),
    }
    dec, _, tensors = roundtrip(tree)
    assert_same(tree, dec)
    assert len(tensors) == 2
    assert set(tensors) == {"t.0", "t.1.0"}


def test_json_scalars_pass_through():
    tree = {"i": -(2**40), "f": 0.1, "nan": math.nan, "inf": -math.inf, "s": "ü✓", "n": None, "b": False, "e": {}}
    dec, enc, tensors = roundtrip(tree)
    assert_same(tree, dec)
    assert tensors == {}
    assert enc is not tree and enc["s"] == "ü✓"


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array([-1, 2**40], dtype=np.int64),
        np.array([True, False, True]),
        np.arange(5, dtype=np.uint8),
        np.array([1.5, -0.0, np.inf], dtype=np.float16),
        np.arange(3, dtype=np.int16),
        np.zeros((2, 0, 3), dtype=np.float64),
        np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2],  # not contiguous
        np.arange(6, dtype=np.float64)[::-1],  # negative stride
    ],
    ids=lambda a: f"{a.dtype}{list(a.shape)}",
)
def test_numpy_arrays_come_back_as_numpy(arr):
    dec, enc, tensors = roundtrip({"x": arr, "l": [arr]})
    assert "__ndarray__" in enc["x"]
    assert_same(arr, dec["x"])
    assert_same(arr, dec["l"][0])


def test_numpy_zero_dim_array_keeps_its_shape():
    """A 0-d ndarray (np.array(3.5), np.asarray(x)) comes back 0-d, not as shape (1,)."""
    arr = np.array(3.5)
    dec, _, _ = roundtrip({"x": arr})
    assert isinstance(dec["x"], np.ndarray)
    assert dec["x"].shape == (), f"shape {dec['x'].shape}"
    assert dec["x"] == 3.5


def test_numpy_array_is_snapshot_independent_of_later_strided_changes():
    """A non-contiguous array's values are captured at encode time (the copy is made then)."""
    base = np.arange(10, dtype=np.int64)
    view = base[::2]
    tensors: dict[str, torch.Tensor] = {}
    enc = codec.encode({"v": view}, "", tensors)
    base[:] = -1
    dec = codec.decode(enc, tensors, "w")
    np.testing.assert_array_equal(dec["v"], [0, 2, 4, 6, 8])


def test_numpy_non_native_byte_order_is_saved_or_rejected_by_key():
    """A big-endian array either round-trips or raises UnsupportedStateError naming its key (as documented)."""
    arr = np.arange(4, dtype=">f4")
    try:
        dec, _, _ = roundtrip({"stats": {"mean": arr}})
    except UnsupportedStateError as e:
        assert "stats.mean" in str(e)
    else:
        np.testing.assert_array_equal(dec["stats"]["mean"], arr)


def test_numpy_unsupported_dtype_names_key():
    with pytest.raises(UnsupportedStateError, match=r"^cfg\.obj: NumPy dtype object"):
        codec.encode({"obj": np.array([object()], dtype=object)}, "cfg", {})


@pytest.mark.parametrize(
    "value, expected",
    [
        (np.float32(1.5), 1.5),
        (np.float64(-2.25), -2.25),
        (np.int64(7), 7),
        (np.int8(-3), -3),
        (np.uint32(4000000000), 4000000000),
        (np.bool_(True), True),
        (np.str_("hi"), "hi"),
    ],
)
def test_numpy_scalars_become_python_scalars(value, expected):
    dec, _, tensors = roundtrip({"v": value, "t": (value,)})
    assert_same(expected, dec["v"])
    assert_same((expected,), dec["t"])
    assert tensors == {}


def test_dict_with_non_string_keys():
    """Keys that are ints, floats, bools or None keep their type; order is kept."""
    tree = {0: "zero", 2.5: "f", None: "none", "s": "str", True: [1, 2], -7: {3: torch.tensor([1.0])}}
    dec, enc, tensors = roundtrip(tree)
    assert_same(tree, dec)
    assert list(tensors) == ["-7.3"]


@pytest.mark.parametrize("marker", ["__tensor__", "__ndarray__", "__tuple__", "__items__"])
def test_user_dict_with_marker_key_is_not_a_reference(marker):
    """A user dict whose single key is a codec marker round-trips as that plain dict."""
    tree = {"w": torch.ones(2), "u": {marker: "w"}, "v": {marker: [["w", 1]]}}
    dec, _, _ = roundtrip(tree)
    assert_same(tree, dec)
    assert dec["u"] == {marker: "w"}


def test_dict_with_marker_key_among_others_is_plain():
    tree = {"cfg": {"__tensor__": "w", "other": 1}}
    dec, enc, _ = roundtrip(tree)
    assert enc == tree
    assert_same(tree, dec)


def test_tensor_keys_are_dotted_paths_and_never_collide():
    """Tensors go under dotted keys; two paths that join to the same key get distinct entries."""
    t1, t2, t3 = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])
    tree = {"a.b": t1, "a": {"b": t2}, "c": [t3]}
    dec, _, tensors = roundtrip(tree, "m")
    assert set(tensors) == {"m.a.b", "m.a.b~1", "m.c.0"}
    assert_same(tree, dec)


def test_encode_keeps_tensor_identity_and_dtype():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    tensors: dict[str, torch.Tensor] = {}
    enc = codec.encode({"x": t}, "p", tensors)
    assert enc == {"x": {"__tensor__": "p.x"}}
    assert tensors["p.x"] is t


@pytest.mark.parametrize(
    "tree, prefix, path",
    [
        ({"model": {"layers": [{"fn": lambda: 0}]}}, "", "model.layers.0.fn"),
        ({"s": {1, 2}}, "opt", "opt.s"),
        ({"o": object()}, "user", "user.o"),
        ({"bytes": b"abc"}, "", "bytes"),
        ([1, (2, complex(1, 2))], "sched", "sched.1.1"),
        ({3: {"deep": range(3)}}, "x", "x.3.deep"),
    ],
)
def test_unsupported_values_name_their_key(tree, prefix, path):
    with pytest.raises(UnsupportedStateError) as e:
        codec.encode(tree, prefix, {})
    assert str(e.value).startswith(f"{path}: "), str(e.value)
    assert "pickle" in str(e.value)
    assert isinstance(e.value, PreemptError)


def test_unsupported_top_level_value_says_state():
    with pytest.raises(UnsupportedStateError, match=r"^state: a builtins\.object"):
        codec.encode(object(), "", {})


def test_unsupported_dict_key_names_path():
    with pytest.raises(UnsupportedStateError, match=r"^cfg\.inner: dict key \(1, 2\) of type tuple"):
        codec.encode({"inner": {(1, 2): 3}}, "cfg", {})


@pytest.mark.parametrize("tag", ["__tensor__", "__ndarray__"])
def test_decode_missing_tensor_raises(tag):
    with pytest.raises(ValueError, match=r"ckpt/user\.json: reference to tensor 'gone'"):
        codec.decode({"a": [{tag: "gone"}]}, {"other": torch.ones(1)}, "ckpt/user.json")


@pytest.mark.parametrize(
    "tree",
    [{"__tensor__": 5}, {"__tuple__": "abc"}, {"__items__": [[1]]}, {"__items__": "x"}, {"__items__": [[1, 2, 3]]}],
)
def test_decode_malformed_tags_raise(tree):
    with pytest.raises(ValueError, match="where.json"):
        codec.decode({"k": tree}, {}, "where.json")


def test_check_json_accepts_plain_json():
    codec.check_json({"a": [1, 2.5, math.nan, None, True, "s", {"b": []}], "t": (1, 2)}, "meta")


@pytest.mark.parametrize(
    "value, message",
    [
        ({"a": {1: 2}}, r"^meta\.a: key 1 is not a string"),
        ({"a": [0, {"b": object()}]}, r"^meta\.a\[1\]\.b: a object is not JSON"),
        ({"s": {1}}, r"^meta\.s: a set is not JSON"),
        (torch.ones(1), r"^meta: a Tensor is not JSON"),
    ],
)
def test_check_json_rejects_with_path(value, message):
    with pytest.raises(UnsupportedStateError, match=message):
        codec.check_json(value, "meta")


def test_ordered_dict_decodes_to_equal_dict():
    od = collections.OrderedDict([("b", 1), ("a", torch.zeros(1))])
    dec, _, _ = roundtrip(od)
    assert type(dec) is dict
    assert dec.keys() == od.keys()
    assert dec["b"] == 1 and torch.equal(dec["a"], od["a"])


def test_plain_dict_key_order_survives_json():
    """Iteration order of a string-keyed dict survives encode -> codec.dumps -> decode.

    Dicts with non-string keys keep their order (a list of pairs); string-keyed
    ones must too, since code that iterates a restored dict (summing per-key
    floats, an LRU cache) otherwise behaves differently after a resume.
    """
    tree = {"tracked": {"zeta": 1.0, "alpha": 2.0, "mid": 3.0}}
    dec, _, _ = roundtrip(tree)
    assert list(dec["tracked"]) == ["zeta", "alpha", "mid"]


# ------------------------------------------------------------------ hostile or runaway input


def _nested(depth: int) -> Any:
    tree: Any = 0
    for _ in range(depth):
        tree = [tree]
    return tree


@pytest.mark.parametrize("make", [lambda: _nested(100_000), lambda: {"__tuple__": _nested(100_000)}])
def test_decode_of_a_tree_deeper_than_the_stack_is_a_value_error(make):
    with pytest.raises(ValueError, match=r"^ckpt/state.json: nested too deeply"):
        codec.decode(make(), {}, "ckpt/state.json")


def test_decode_items_with_unhashable_keys_is_a_value_error():
    with pytest.raises(ValueError, match=r"^w.json: __items__ must hold \[key, value\] pairs whose keys are JSON"):
        codec.decode({"__items__": [[[1, 2], "v"]]}, {}, "w.json")


def test_decode_names_a_long_reference_briefly():
    with pytest.raises(ValueError, match=r"reference to tensor 'xxx.*\(100002 characters\)") as e:
        codec.decode({"__tensor__": "x" * 100_000}, {}, "w.json")
    assert len(str(e.value)) < 400


def test_encode_of_a_state_that_holds_itself_names_it():
    loop: dict[str, Any] = {"a": 1}
    loop["self"] = loop
    with pytest.raises(UnsupportedStateError, match=r"^user: nested too deeply \(or a container holds itself\)"):
        codec.encode({"k": loop}, "user", {})
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(UnsupportedStateError, match=r"^meta: nested too deeply"):
        codec.check_json(cycle, "meta")


def test_loads_parses_json_from_bytes_and_buffers():
    assert codec.loads(b'{"a": [1, NaN]}', "w")["a"][0] == 1
    assert codec.loads(np.frombuffer(b'{"b": 2}', dtype=np.uint8), "w") == {"b": 2}


@pytest.mark.parametrize(
    "data, found",
    [
        (b"\x80\x04\x95\x10\x00\x00\x00", r"found a pickle stream \(protocol 4\): preempt never unpickles"),
        (b"\x80\x02}q\x00.", r"found a pickle stream \(protocol 2\)"),
        (b"PK\x03\x04\x14\x00\x00\x00\x08\x00", r"found a zip archive \(what torch.save writes\)"),
        (b"[" * 100_000, r"ValueError: nested deeper than 64 levels"),  # checked before parsing
        (b"[" + b"9" * 5000 + b"]", r"ValueError: Exceeds the limit"),
        (b"\xc3\x28", r"UnicodeDecodeError"),
        (b"{'a': 1}", r"JSONDecodeError"),
    ],
    ids=["pickle-4", "pickle-2", "torch.save", "deep", "huge-int", "bad-utf8", "python-literal"],
)
def test_loads_says_what_it_found_instead_of_json(data, found):
    with pytest.raises(ValueError, match=r"^ckpt/state.json: expected JSON, " + found):
        codec.loads(data, "ckpt/state.json")
