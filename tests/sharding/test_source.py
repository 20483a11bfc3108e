"""Shards filled from a reader: ``TensorFiles`` reads any element range of a safetensors file
exactly, and an engine built on the meta device from a source holds what one built from the
parameters holds, bit for bit (on one process; tests/test_weights.py runs 4 ranks on real files).
"""

import struct

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from rlhf_paro.sharding import Topology, TensorFiles, shard
from tests.sharding.parity import build_model


def test_every_element_range_reads_the_flattened_tensor_in_its_own_dtype(tmp_path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(5, 7, generator=gen), "b": torch.randn(3, generator=gen).bfloat16(),
               "h": torch.randn(2, 3, 4, generator=gen).half(),
               "i": torch.arange(6, dtype=torch.int64).reshape(2, 3), "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file({"other": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    files = TensorFiles([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert sorted(files.keys()) == sorted([*tensors, "other"]) and "w" in files
    assert files.shape("h") == (2, 3, 4)
    for key, value in tensors.items():
        flat = value.reshape(-1)
        for start in range(flat.numel() + 1):
            for stop in range(start, flat.numel() + 1):
                got = files.read(key, start, stop)
                assert got.dtype == value.dtype and torch.equal(got, flat[start:stop])
    with pytest.raises(IndexError, match="'b' has 3 elements; asked for 2..4"):
        files.read("b", 2, 4)


def test_damaged_files_are_refused_naming_the_file(tmp_path) -> None:
    save_file({"w": torch.ones(4)}, str(tmp_path / "ok.safetensors"))
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-4])  # the last element is gone
    (tmp_path / "junk.safetensors").write_bytes(struct.pack("<Q", 10 ** 12) + b"{}")
    with pytest.raises(ValueError, match="cut.safetensors: tensor 'w' does not fit its byte"):
        TensorFiles([tmp_path / "cut.safetensors"])
    with pytest.raises(ValueError, match="junk.safetensors is not a readable safetensors"):
        TensorFiles([tmp_path / "junk.safetensors"])
    with pytest.raises(ValueError, match="tensor 'w' is also in"):
        TensorFiles([tmp_path / "ok.safetensors", tmp_path / "ok.safetensors"])


def _parameters_on_meta(model: nn.Module) -> nn.Module:
    """``model`` with its parameters on the meta device and its buffers (rotary tables) kept."""
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None:  # a Linear without bias holds None
                module._parameters[key] = nn.Parameter(p.detach().to("meta"), p.requires_grad)
    return model


@pytest.mark.parametrize("strategy, precision", [("NNN", "fp32"), ("GGG", "fp32"),
                                                 ("IGG", "bf16"), ("G", "bf16")])
def test_a_meta_model_filled_from_a_source_equals_one_built_whole(strategy, precision) -> None:
    # N = 1 keeps every level whole, so this holds the whole P shard, the bf16 master and the
    # parameters' views; the 4-rank run on files is tests/test_weights.py.
    whole = build_model("base")
    values = {name: p.detach().clone() for name, p in whole.named_parameters()}
    calls = []

    def source(name: str, start: int, stop: int) -> torch.Tensor:
        calls.append(name)
        return values[name].reshape(-1)[start:stop]

    ref = shard(whole, strategy, Topology(1, 1), precision=precision)
    meta = _parameters_on_meta(build_model("base"))  # only the source can give values now
    engine = shard(meta, strategy, Topology(1, 1), precision=precision, source=source,
                   device="cpu")
    assert set(calls) == set(values)
    assert not any(p.is_meta for p in meta.parameters())
    got, want = engine.state_dict()["tensors"], ref.state_dict()["tensors"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items())
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        assert torch.equal(engine(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_a_meta_model_without_a_source_or_a_device_is_refused() -> None:
    model = _parameters_on_meta(build_model("base"))
    with pytest.raises(ValueError, match="is on the meta device and no source was given"):
        shard(model, "GGG", Topology(1, 1))
    with pytest.raises(ValueError, match="allowed: device="):
        shard(model, "GGG", Topology(1, 1), source=lambda name, a, b: torch.zeros(b - a))
