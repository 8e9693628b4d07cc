"""`domainnet`: DomainNet, 6 domains, a class subset (FedBN's 10 by default), `groups["domain"]`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

from fedrepro.data.base import DataMissingError, RawDataset
from fedrepro.data.dataset_registry import DatasetSpec, register_dataset
from fedrepro.data.downloads import Download, contained, extract_zip, fetch
from fedrepro.io import replace_dir
from fedrepro.registry import ConfigError, Param, show
from fedrepro.data.domains._common import check_name_list, domain_images_dataset, missing_error, evenly_spaced
from fedrepro.data.domains.fedbn_digits import find_dir_containing
from fedrepro.data.domains.mnistm import list_entry, read_list_lines


DOMAINNET_DIR = "DomainNet"
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
#: The 10-class subset of FedBN (utils/data_utils.py DomainNetDataset label_dict) that FedGCR
#: reuses (shared/reference/methods.md section 5.6); label = position in this tuple.
FEDBN_DOMAINNET_CLASSES = ("bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill", "wine_glass", "zebra")
DOMAINNET_BASE_URL = "http://csr.bu.edu/ftp/visda/2019/multi-source"
#: The cleaned per-domain archives listed on http://ai.bu.edu/M3SDA/.
DOMAINNET_ZIP_URLS = {
    "clipart": f"{DOMAINNET_BASE_URL}/groundtruth/clipart.zip",
    "infograph": f"{DOMAINNET_BASE_URL}/infograph.zip",
    "painting": f"{DOMAINNET_BASE_URL}/groundtruth/painting.zip",
    "quickdraw": f"{DOMAINNET_BASE_URL}/quickdraw.zip",
    "real": f"{DOMAINNET_BASE_URL}/real.zip",
    "sketch": f"{DOMAINNET_BASE_URL}/sketch.zip",
}
DOMAINNET_TXT_URL = f"{DOMAINNET_BASE_URL}/domainnet/txt/{{domain}}_{{split}}.txt"
#: md5 and size of every DomainNet file (no sha256 is published): datasets-mila/datasets--domainnet
#: (`md5sums` and its git-annex keys MD5E-s<size>--<md5>), the same md5s as the DomainNet loaders of
#: the `ddg` (DomainBed-style) code base and shifthappens' ImageNet-D.
DOMAINNET_PIN_SOURCE = "md5 + size from datasets-mila/datasets--domainnet (md5sums, git-annex keys); same md5 in ddg's loader"
DOMAINNET_PINS: dict[str, tuple[str, int]] = {
    "clipart.zip": ("cd0d8f2d77a4e181449b78ed62bccf1e", 1_270_909_081),
    "infograph.zip": ("720380b86f9e6ab4805bb38b6bd135f8", 4_338_659_804),
    "painting.zip": ("1ae32cdb4f98fe7ab5eb0a351768abfd", 3_679_366_174),
    "quickdraw.zip": ("bdc1b6f09f277da1a263389efe0c7a66", 459_920_701),
    "real.zip": ("dcc47055e8935767784b7162e7c7cca6", 6_062_039_589),
    "sketch.zip": ("658d8009644040ff7ce30bb2e820850f", 2_633_992_926),
    "clipart_train.txt": ("b4349693a7f9c05c53955725c47ed6cb", 1_443_819),
    "clipart_test.txt": ("f5ddbcfd657a3acf9d0f7da10db22565", 628_917),
    "infograph_train.txt": ("379b50054f4ac2018dca4f89421b92d9", 1_683_098),
    "infograph_test.txt": ("779626b50869edffe8ea6941c3755c71", 728_028),
    "painting_train.txt": ("7db0e7ca73ad9982f6e1f7f3ef372c0a", 2_241_901),
    "painting_test.txt": ("232b35dc53f26d414686ae579e38d9b5", 971_888),
    "quickdraw_train.txt": ("b732ced3939ac8efdd8c0a889dca56cc", 5_164_600),
    "quickdraw_test.txt": ("c1a828fdfe216fb109f1c0083a252c6f", 2_213_400),
    "real_train.txt": ("8ebf02c2075fadd564705f0dc7cd6291", 4_440_944),
    "real_test.txt": ("6098816791c3ebed543c71ffa11b9054", 1_911_327),
    "sketch_train.txt": ("1233bd18aa9a8a200bf4cecf1c34ef3e", 1_960_222),
    "sketch_test.txt": ("d8a222e4672cfd585298aa14d02ea441", 850_581),
}


def domainnet_download(name: str) -> Download:
    """The pinned Download of a DomainNet file ('<domain>.zip' or '<domain>_<split>.txt')."""
    if name.endswith(".zip"):
        url = DOMAINNET_ZIP_URLS[name.removesuffix(".zip")]
    else:
        domain, split = name.removesuffix(".txt").rsplit("_", 1)
        url = DOMAINNET_TXT_URL.format(domain=domain, split=split)
    md5, size = DOMAINNET_PINS[name]
    return Download(name, url, md5=md5, size=size, pin_source=DOMAINNET_PIN_SOURCE)
DOMAINNET_SOURCE = (
    "DomainNet (Peng et al., ICCV 2019), http://ai.bu.edu/M3SDA/ : cleaned per-domain zips "
    f"({DOMAINNET_BASE_URL}/...) and the official <domain>_train.txt / <domain>_test.txt splits"
)


def _domainnet_how(domains: Sequence[str]) -> list[str]:
    return [
        "run `fedrepro prepare` with internet access (downloads only the listed domains; clipart 1.3 GB, infograph "
        "4.0 GB, painting 3.7 GB, quickdraw 0.4 GB, real 5.6 GB, sketch 2.5 GB), or",
        f"download from http://ai.bu.edu/M3SDA/ and unzip into {DOMAINNET_DIR}/ (giving {DOMAINNET_DIR}/<domain>/<class>/*.jpg), "
        f"and put the split files there too: "
        + "; ".join(f"{DOMAINNET_ZIP_URLS[d]} + " + DOMAINNET_TXT_URL.format(domain=d, split="{train,test}") for d in domains),
    ]


def _domainnet_missing(root: Path, domains: Sequence[str]) -> list[str]:
    base = Path(root) / DOMAINNET_DIR
    out = []
    for d in domains:
        if not (base / d).is_dir():
            out.append(f"{DOMAINNET_DIR}/{d}/ (image folders <class>/*.jpg)")
        out += [f"{DOMAINNET_DIR}/{d}_{s}.txt" for s in ("train", "test") if not (base / f"{d}_{s}.txt").is_file()]
    return out


def _read_domainnet_txt(path: Path) -> list[tuple[str, str, int]]:
    """Lines 'clipart/aircraft_carrier/clipart_001_000018.jpg 0' -> (relpath, class name, official id).

    Every path must stay inside the DomainNet folder (checked again when the images are read)."""
    rows = []
    base = path.parent
    for i, line in enumerate(read_list_lines(path), 1):
        rel, label = list_entry(path, i, line)
        rel = rel.replace("\\", "/")
        contained(base, rel, f"{path}, line {i}")
        parts = rel.split("/")
        if len(parts) < 3:
            raise DataMissingError(f"{path}, line {i}: {show(rel)} is not '<domain>/<class>/<file>'; the file is not the expected one")
        rows.append((rel, parts[-2], label))
    return rows


def _prepare_domainnet(root: Path, params: dict) -> None:
    root = Path(root)
    domains = check_name_list("dataset 'domainnet'", "domains", params["domains"], DOMAINNET_DOMAINS)
    base = root / DOMAINNET_DIR
    try:
        for d in domains:
            for s in ("train", "test"):
                if not (base / f"{d}_{s}.txt").is_file():
                    fetch(domainnet_download(f"{d}_{s}.txt"), base)
            if not (base / d).is_dir():
                _fetch_domainnet_images(base, d)
    except Exception as exc:
        raise missing_error("DomainNet files are", base, _domainnet_missing(root, domains), _domainnet_how(domains),
                            f"{type(exc).__name__}: {exc}") from None
    missing = _domainnet_missing(root, domains)
    if missing:
        raise missing_error("DomainNet files are", base, missing, _domainnet_how(domains))


def _fetch_domainnet_images(base: Path, domain: str) -> None:
    """Download and verify <domain>.zip, unpack it beside `base/domain` and rename its folder into
    place (a killed extraction leaves only a hidden temporary folder, never a half-filled domain)."""
    archive = fetch(domainnet_download(f"{domain}.zip"), base)
    staging = extract_zip(archive, base, domain)
    try:
        src = find_dir_containing(staging, domain, depth=1)
        if src is None:
            raise DataMissingError(f"{archive.name} holds no {domain}/ folder")
        replace_dir(src / domain, base / domain)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    archive.unlink(missing_ok=True)


def _domainnet_classes(params: dict, official: dict[str, int]) -> list[str]:
    spec = params["classes"]
    where = "dataset 'domainnet'"
    if isinstance(spec, int):
        if not 1 <= spec <= len(official):
            raise ConfigError(f"{where}: key 'classes' has value {spec}; allowed: 1..{len(official)} (first k classes by official id)")
        return sorted(official, key=official.get)[:spec]
    names = list(spec)
    unknown = [c for c in names if c not in official]
    if not names or unknown or len(set(names)) != len(names):
        raise ConfigError(
            f"{where}: key 'classes' has value {spec!r}; allowed: distinct DomainNet class names found in the split files "
            f"(unknown: {unknown}), or an int k for the first k classes by official id"
        )
    return names


def _load_domainnet(root: Path, params: dict) -> RawDataset:
    root = Path(root)
    base = root / DOMAINNET_DIR
    domains = check_name_list("dataset 'domainnet'", "domains", params["domains"], DOMAINNET_DOMAINS)
    missing = _domainnet_missing(root, domains)
    if missing:
        raise missing_error("DomainNet files are", base, missing, _domainnet_how(domains))
    rows = {(d, s): _read_domainnet_txt(base / f"{d}_{s}.txt") for d in domains for s in ("train", "test")}
    official = {name: cid for r in rows.values() for _, name, cid in r}
    classes = _domainnet_classes(params, official)
    index = {c: i for i, c in enumerate(classes)}
    cap = params["max_per_domain"]
    paths, labels, splits, dom = [], [], [], []
    for i, d in enumerate(domains):
        for k, s in enumerate(("train", "test")):
            sel = [(rel, index[name]) for rel, name, _ in rows[(d, s)] if name in index]
            sel = [sel[j] for j in evenly_spaced(len(sel), cap)]
            paths += [contained(base, rel, f"{base / f'{d}_{s}.txt'}") for rel, _ in sel]
            labels += [lab for _, lab in sel]
            splits += [k] * len(sel)
            dom += [i] * len(sel)
    absent = [p for p in paths if not os.path.isfile(p)]
    if absent:
        raise DataMissingError(
            f"DomainNet: {len(absent)} images listed in the split files are missing, e.g. {absent[:3]}\n"
            + "\n".join(_domainnet_how(domains))
        )
    source = f"{DOMAINNET_SOURCE} [domains (id order): {', '.join(domains)}; classes (label order): {', '.join(classes)}]"
    return domain_images_dataset("domainnet", paths, labels, splits, dom, int(params["image_size"]), len(classes), source)


register_dataset(
    DatasetSpec(
        name="domainnet",
        summary="DomainNet: clipart / infograph / painting / quickdraw / real / sketch, class subset (default FedBN's 10), domain id",
        source=DOMAINNET_SOURCE,
        num_classes=len(FEDBN_DOMAINNET_CLASSES),
        sample_shape=(3, 64, 64),
        size="~586k images over 345 classes; the default 10-class subset is a few thousand per domain",
        params={
            "image_size": Param(64, "side S of the 3xSxS images (PIL bilinear resize; FedBN/FedGCR resize to 224)", int, minimum=4),
            "classes": Param(
                list(FEDBN_DOMAINNET_CLASSES),
                "class names (label = position in the list; default FedBN's / FedGCR's 10 classes), or an int k for the "
                "first k classes by official id (345 = all)",
                (list, tuple, int),
            ),
            "domains": Param(
                list(DOMAINNET_DOMAINS),
                "the domains to include; groups['domain'] is the index in this list (FedGCR's DIF order: "
                "clipart, real, painting, sketch, quickdraw, infograph)",
                (list, tuple),
            ),
            "max_per_domain": Param(
                None,
                "optional cap on the images of each (domain, official split), evenly spaced over the split file; None = all",
                (int, type(None)),
                minimum=1,
            ),
        },
        prepare=_prepare_domainnet,
        load=_load_domainnet,
    )
)
