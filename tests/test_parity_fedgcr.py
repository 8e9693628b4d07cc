"""benchmarks/parity_fedgcr.py without the reference checkout: the export in the FedGCR code's
DigitsDataset format reads back (the way the code reads it: pickle, PIL, ToTensor, Normalize)
to exactly fedrepro's client tensors, every client and split; and the shims' renaming/padding."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from fedrepro.data.base import RawDataset
from fedrepro.data.shards import load_partition, write_partition
from fedrepro.engine.data import load_clients

from conftest import load_script

parity = load_script("benchmarks/parity_fedgcr.py")


def images(channels: int, n: int = 120, seed: int = 0) -> RawDataset:
    g = np.random.default_rng(seed)
    domain = np.repeat(np.arange(3), n // 3)
    return RawDataset(name=f"img{channels}", x=g.integers(0, 256, (n, channels, 6, 6), dtype=np.uint8),
                      y=g.integers(0, 4, n), num_classes=4, official_split=np.zeros(n, np.int8),
                      mean=(0.3,) * channels, std=(0.2,) * channels, source="generated in the test",
                      groups={"domain": domain})


@pytest.mark.parametrize("channels", [1, 3])
def test_export_reads_back_as_the_engines_client_tensors(tmp_path, channels):
    spec = {"dataset": f"img{channels}", "partitioner": "domain", "num_clients": 4, "seed": 0,
            "params": {"dif": 2.0}, "split": {"test_fraction": 0.4}}
    write_partition(images(channels), spec, tmp_path / "part")
    manifest, shards = load_partition(tmp_path / "part")
    meta = parity.export_reference(manifest, shards, tmp_path / "export")
    clients = load_clients(manifest, shards, torch.device("cpu"))  # what the engine trains and tests on
    assert sorted(int(c) for c in meta["clients"]) == sorted(c.id for c in clients)
    for c in clients:
        for split, want in (("train", c.train), ("test", c.test)):
            x, y = parity.read_reference_client(tmp_path / "export" / f"client{c.id}", channels, meta["mean"],
                                                meta["std"], split == "train")
            assert np.array_equal(y, want.y.numpy())
            assert x.shape == tuple(want.x.shape)
            np.testing.assert_allclose(x, want.x.numpy(), rtol=0, atol=1e-6)
    # the script's own check agrees, and catches a changed tensor
    tensors = parity.client_tensors(manifest, shards)
    parity.check_export(meta, tmp_path / "export", tensors)
    first = min(tensors)
    tensors[first]["test"] = (tensors[first]["test"][0] + 0.01, tensors[first]["test"][1])
    with pytest.raises(SystemExit, match=f"client {first} test"):
        parity.check_export(meta, tmp_path / "export", tensors)


def test_shims_rename_for_the_codes_key_filters_and_pad_to_its_width():
    assert parity.ref_name("extractor.prompts") == "extractor__prompts"  # 'prompt' in key (util.py:1168)
    assert parity.ref_name("extractor.gc_net.0.weight") == "extractor__meta_net__0__weight"  # the code's meta_net
    assert parity.ref_name("head.bias") == "head__bias"
    params = {"extractor.prompts": torch.ones(2, 3), "head.weight": torch.zeros(4, 3), "step": torch.tensor([3])}
    m = parity.holder(params)
    m.state_dict()["head__weight"].data.copy_(torch.full((4, 3), 2.0))  # how communication() writes
    back = parity.read_back(m, ["extractor.prompts", "head.weight"])
    assert torch.equal(back["head.weight"], torch.full((4, 3), 2.0)) and "step" not in dict(m.named_buffers())
    reps = torch.randn(5, 64)
    padded = parity.pad(reps)
    assert padded.shape == (5, parity.REF_WIDTH) and torch.equal(padded[:, :64], reps) and not padded[:, 64:].any()


def test_rows_pair_each_fedrepro_method_with_the_codes_mode():
    runs = parity.runs_of(parity.ROWS)
    names = {r.name for r in parity.ROWS}
    assert {"FedGCR", "FedGR only", "FedGC only", "FedAvg", "q-FFL", "AFL", "TERM"} <= names
    ref = {r.name: hp for side, r, m, hp in runs if side == "R"}
    assert ref["FedGCR"]["ref_mode"] == "fedgcr" and ref["FedGCR"]["group_loss"] == "size_weighted"
    assert ref["q-FFL"] == {"ref_mode": "q-ffl", "loss_at": "train"}
