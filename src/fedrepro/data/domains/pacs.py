"""`pacs`: PACS, photo / art_painting / cartoon / sketch, 7 classes, `groups["domain"]`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

from fedrepro.data.base import DataMissingError, RawDataset
from fedrepro.data.dataset_registry import DatasetSpec, register_dataset
from fedrepro.data.downloads import Download, UnpinnedDownloadError, extract_zip, fetch
from fedrepro.io import replace_dir
from fedrepro.registry import Param
from fedrepro.data.domains._common import check_name_list, domain_images_dataset, missing_error, refused_error
from fedrepro.data.domains.fedbn_digits import find_dir_containing


PACS_DIR = "PACS"
PACS_DOMAINS = ("photo", "art_painting", "cartoon", "sketch")
PACS_CLASSES = ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")  # official label order 1..7
PACS_GDRIVE_ID = "1JFr8f805nMUelQWWmfnJR3y4_SYoN5Pd"  # DomainBed's PACS.zip (folder kfold/)
PACS_SOURCE = (
    "PACS (Li et al., ICCV 2017), https://domaingeneralization.github.io/ ; image folders <domain>/<class>/ as in the "
    f"release's kfold/ folder (DomainBed mirror: https://drive.google.com/uc?id={PACS_GDRIVE_ID})"
)
#: DomainBed's PACS.zip: no checksum is published, so downloaded only with the operator's opt-in.
PACS_DOWNLOAD = Download("PACS.zip", f"https://drive.google.com/uc?id={PACS_GDRIVE_ID}", gdrive_id=PACS_GDRIVE_ID)
PACS_HOW = [
    f"run `fedrepro prepare` with internet access and `gdown` installed (pip install gdown): it downloads DomainBed's "
    f"PACS.zip (Google Drive id {PACS_GDRIVE_ID}) and renames its kfold/ folder to {PACS_DIR}/, or",
    "download PACS from https://domaingeneralization.github.io/ (or the Google Drive link above), unzip it and rename "
    f"the kfold/ folder to {PACS_DIR}/ in the data root",
    f"for split='kfold' also put the official split lists <domain>_train_kfold.txt and <domain>_crossval_kfold.txt "
    f"(from the same site) into {PACS_DIR}/",
]


def _pacs_missing(root: Path, domains: Sequence[str], split: str) -> list[str]:
    base = Path(root) / PACS_DIR
    out = [f"{PACS_DIR}/{d}/{c}/" for d in domains for c in PACS_CLASSES if not (base / d / c).is_dir()]
    if split == "kfold":
        out += [
            f"{PACS_DIR}/{d}_{s}_kfold.txt" for d in domains for s in ("train", "crossval") if not (base / f"{d}_{s}_kfold.txt").is_file()
        ]
    return out


def _last3(path: str) -> str:
    return "/".join(path.strip().replace("\\", "/").strip("/").split("/")[-3:])


def _pacs_samples(root: Path, domain: str, split: str) -> tuple[list[str], list[int], list[int]]:
    """(paths, labels, official split) of one domain, in sorted class / file order."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    base = Path(root) / PACS_DIR
    class_to_idx = {c: i for i, c in enumerate(PACS_CLASSES)}
    try:
        samples = make_dataset(str(base / domain), class_to_idx, extensions=IMG_EXTENSIONS)
    except FileNotFoundError as exc:  # a class folder without any image
        raise DataMissingError(f"PACS: {exc} (under {base / domain})\n" + "\n".join(PACS_HOW)) from None
    paths = [p for p, _ in samples]
    labels = [int(t) for _, t in samples]
    if split == "none":
        return paths, labels, [0] * len(paths)
    listed: dict[str, int] = {}
    for k, s in ((0, "train"), (1, "crossval")):
        for line in (base / f"{domain}_{s}_kfold.txt").read_text().splitlines():
            if line.strip():
                listed[_last3(line.split()[0])] = k
    by_key = {_last3(os.path.relpath(p, base)): (p, t) for p, t in zip(paths, labels)}
    absent = [k for k in listed if k not in by_key]
    if absent:
        raise DataMissingError(f"PACS: {len(absent)} images listed in the {domain} kfold files are missing under {base}, e.g. {absent[:3]}")
    keys = [k for k in by_key if k in listed]  # folder order; unlisted images are dropped
    return [by_key[k][0] for k in keys], [by_key[k][1] for k in keys], [listed[k] for k in keys]


def _prepare_pacs(root: Path, params: dict) -> None:
    root = Path(root)
    domains = check_name_list("dataset 'pacs'", "domains", params["domains"], PACS_DOMAINS)
    missing = _pacs_missing(root, domains, "none")
    if missing:
        staging = None
        try:
            root.mkdir(parents=True, exist_ok=True)
            staging = extract_zip(fetch(PACS_DOWNLOAD, root), root, PACS_DIR)
            src = find_dir_containing(staging, "art_painting")
            if src is None:
                raise DataMissingError("PACS.zip holds no art_painting/ folder")
            replace_dir(src, root / PACS_DIR)
        except UnpinnedDownloadError as exc:
            raise refused_error("PACS image folders are", root / PACS_DIR, _pacs_missing(root, domains, params["split"]),
                                PACS_HOW, exc) from None
        except Exception as exc:
            raise missing_error("PACS image folders are", root / PACS_DIR, _pacs_missing(root, domains, params["split"]),
                                PACS_HOW, f"{type(exc).__name__}: {exc}") from None
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            (root / "PACS.zip").unlink(missing_ok=True)
    missing = _pacs_missing(root, domains, params["split"])
    if missing:
        raise missing_error("PACS files are", root / PACS_DIR, missing, PACS_HOW)


def _load_pacs(root: Path, params: dict) -> RawDataset:
    root = Path(root)
    domains = check_name_list("dataset 'pacs'", "domains", params["domains"], PACS_DOMAINS)
    missing = _pacs_missing(root, domains, params["split"])
    if missing:
        raise missing_error("PACS files are", root / PACS_DIR, missing, PACS_HOW)
    paths, labels, splits, dom = [], [], [], []
    for i, d in enumerate(domains):
        p, y, s = _pacs_samples(root, d, params["split"])
        paths += p
        labels += y
        splits += s
        dom += [i] * len(p)
    source = f"{PACS_SOURCE} [domains (id order): {', '.join(domains)}; split: {params['split']}]"
    return domain_images_dataset("pacs", paths, labels, splits, dom, int(params["image_size"]), len(PACS_CLASSES), source)


register_dataset(
    DatasetSpec(
        name="pacs",
        summary="PACS: photo / art_painting / cartoon / sketch, 7 object classes, 3xSxS, domain id per sample",
        source=PACS_SOURCE,
        num_classes=7,
        sample_shape=(3, 64, 64),
        size="9,991 images (photo 1,670, art_painting 2,048, cartoon 2,344, sketch 3,929)",
        params={
            "image_size": Param(64, "side S of the 3xSxS images (PIL bilinear resize; FedGCR resizes to 224)", int, minimum=4),
            "domains": Param(list(PACS_DOMAINS), "the domains to include; groups['domain'] is the index in this list", (list, tuple)),
            "split": Param(
                "none",
                "'none': every image has official_split 0 (FedGCR splits within each domain); 'kfold': the release's "
                "<domain>_train_kfold.txt -> 0 and <domain>_crossval_kfold.txt -> 1",
                str,
                choices=("none", "kfold"),
            ),
        },
        prepare=_prepare_pacs,
        load=_load_pacs,
    )
)
