"""The offline multi-domain dataset (`shifted_domains`), the proxy-pretrained backbone
(`weights: proxy`, `fedrepro pretrain-backbone`) and their config resolution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedrepro.cli import main
from fedrepro.config import resolve_experiment
from fedrepro.data.datasets import load_dataset, prepare_dataset
from fedrepro.data.domains.shifted import _assignment, _base, proxy_images
from fedrepro.models import build_model
from fedrepro.registry import ConfigError

DIGITS = {"base": "digits", "domains": ["gray", "invert", "lowres"], "per_domain": 200, "image_size": 8, "seed": 0}
TINY = {"backbone": "vit_tiny_patch16_224", "backbone_args": {"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1,
                                                                "num_heads": 2}, "resize": False}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("shifted")
    prepare_dataset("shifted_domains", root, DIGITS)
    return root


def test_shifted_domains_are_disjoint_styled_and_leave_a_proxy(root):
    raw = load_dataset("shifted_domains", root, DIGITS)
    assert raw.x.shape == (600, 3, 8, 8) and raw.x.dtype == np.uint8
    assert np.bincount(raw.groups["domain"]).tolist() == [200, 200, 200]
    means = [raw.x[raw.groups["domain"] == d].mean() for d in range(3)]
    assert means[1] > 128 > means[0]  # invert: light ground; gray: dark ground
    base = _base(root, {**DIGITS})
    perm, parts = _assignment(len(base.y), DIGITS)
    used = np.concatenate(parts)
    assert len(np.unique(used)) == 600  # every base image in at most one domain
    x, y, c = proxy_images(root, DIGITS, None, seed=0)
    assert len(y) == len(base.y) - 600 and c == 10
    assert not set(perm[600:]) & set(used)  # the proxy is held out of every domain
    assert np.array_equal(proxy_images(root, DIGITS, 50, seed=0)[0], x[:50])


def _config(model_params, pretrain=None, dataset="shifted_domains", params=DIGITS):
    model = {"name": "prompted_vit", "params": model_params}
    if pretrain is not None:
        model["pretrain"] = pretrain
    return {"experiment": "unit", "datasets": {dataset: {"params": params, "model": model}},
            "partitions": {"dif": {"partitioner": "domain", "num_clients": 3, "params": {"dif": 1.0}}} if dataset ==
            "shifted_domains" else {"iid": {"partitioner": "iid", "num_clients": 3}},
            "methods": {"fedgcr": {}}, "seeds": [0], "training": {"rounds": 1}}


def test_proxy_weights_resolve_to_a_content_addressed_checkpoint():
    exp = resolve_experiment(_config({**TINY, "weights": "proxy"}, {"epochs": 1, "samples": 300}))
    info = exp["datasets"]["shifted_domains"]
    path = info["model"]["params"]["weights"]
    assert path.startswith("results/pretrained/shifted_domains/") and path.endswith(".pt")
    assert exp["cells"][0]["model"]["params"]["weights"] == path  # the cell loads exactly that file
    assert info["pretrained"]["out"] == path and info["pretrained"]["spec"]["epochs"] == 1
    other = resolve_experiment(_config({**TINY, "weights": "proxy"}, {"epochs": 2, "samples": 300}))
    assert other["datasets"]["shifted_domains"]["pretrained"]["out"] != path
    with pytest.raises(ConfigError, match="datasets.digits.model.params.weights.*proxy"):
        resolve_experiment(_config({**TINY, "weights": "proxy"}, dataset="digits", params={}))
    with pytest.raises(ConfigError, match="datasets.shifted_domains.model.pretrain"):
        resolve_experiment(_config({**TINY, "weights": "none"}, {"epochs": 1}))
    with pytest.raises(ConfigError, match="pretrain.*epochs"):
        resolve_experiment(_config({**TINY, "weights": "proxy"}, {"epochs": 0}))


def test_proxy_styles_choose_the_pretraining_source_and_keep_existing_paths(root):
    # styles: [gray] renders every proxy image as the grey original (a source unlike the clients'
    # other domains); the default draws each image's style from the dataset's domains
    x, _, _ = proxy_images(root, DIGITS, 120, seed=0)
    gray, _, _ = proxy_images(root, DIGITS, 120, seed=0, styles=["gray"])
    base = _base(root, DIGITS)
    perm, parts = _assignment(len(base.y), DIGITS)
    held_out = base.x[perm[600:720]]
    assert np.array_equal(gray, np.repeat(held_out, 3, axis=1))
    assert not np.array_equal(x, gray)
    default = resolve_experiment(_config({**TINY, "weights": "proxy"}, {"epochs": 1}))
    explicit_null = resolve_experiment(_config({**TINY, "weights": "proxy"}, {"epochs": 1, "styles": None}))
    only_gray = resolve_experiment(_config({**TINY, "weights": "proxy"}, {"epochs": 1, "styles": ["gray"]}))
    path = lambda exp: exp["datasets"]["shifted_domains"]["pretrained"]["out"]  # noqa: E731
    assert "styles" not in default["datasets"]["shifted_domains"]["pretrained"]["spec"]
    assert path(explicit_null) == path(default) != path(only_gray)
    assert only_gray["datasets"]["shifted_domains"]["pretrained"]["spec"]["styles"] == ["gray"]
    with pytest.raises(ConfigError, match="pretrain.*styles.*'grey'.*allowed.*gray"):
        resolve_experiment(_config({**TINY, "weights": "proxy"}, {"epochs": 1, "styles": ["grey"]}))
    with pytest.raises(ConfigError, match="pretrain.*styles"):
        resolve_experiment(_config({**TINY, "weights": "proxy"}, {"epochs": 1, "styles": []}))


def test_pretrain_backbone_is_deterministic_and_loadable(root, tmp_path):
    import json

    exp = resolve_experiment(_config({**TINY, "weights": "proxy"}, {"epochs": 1, "samples": 256, "batch_size": 64}))
    spec = json.dumps(exp["datasets"]["shifted_domains"]["pretrained"]["spec"])
    outs = [tmp_path / "a.pt", tmp_path / "b.pt"]
    for out in outs:
        assert main(["pretrain-backbone", "--spec", spec, "--root", str(root), "--out", str(out), "--threads", "1"]) in (0, None)
    a, b = (torch.load(p, weights_only=True) for p in outs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(123)
    random_init = build_model("prompted_vit", (3, 8, 8), 10, {**TINY, "weights": "none"}).extractor.backbone.state_dict()
    model = build_model("prompted_vit", (3, 8, 8), 10, {**TINY, "weights": str(outs[0])})
    loaded = model.extractor.backbone.state_dict()
    assert all(torch.equal(loaded[k], a[k]) for k in a)
    assert any(not torch.equal(random_init[k], a[k]) for k in a)  # it did train
    assert not any(p.requires_grad for p in model.extractor.backbone.parameters())


def test_method_model_and_partition_requirements_are_checked_before_any_job():
    digits_mlp = {"experiment": "unit", "datasets": {"digits": {}}, "partitions": {"iid": {"partitioner": "iid", "num_clients": 3}},
                  "methods": {"gcr": {"method": "fedgcr"}}, "seeds": [0], "training": {"rounds": 1}}
    with pytest.raises(ConfigError, match="methods.gcr.*needs the model prompted_vit.*'mlp'"):
        resolve_experiment(digits_mlp)
    digits_mlp["methods"] = {"harmofl": {}}
    with pytest.raises(ConfigError, match="methods.harmofl.*prompted_vit"):
        resolve_experiment(digits_mlp)
    iid = _config({**TINY, "weights": "none"}, dataset="digits", params={})
    with pytest.raises(ConfigError, match="methods.fedgcr.hparams.num_groups.*'iid'"):
        resolve_experiment(iid)
    iid["methods"] = {"fedgcr": {"hparams": {"num_groups": 2}}}
    assert resolve_experiment(iid)["cells"]
    no_gc = _config({**TINY, "weights": "none", "gc_net": False})
    with pytest.raises(ConfigError, match="group_customization.*gc_net"):
        resolve_experiment(no_gc)
