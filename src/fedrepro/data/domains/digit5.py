"""`digit5`: Digit-Five (MNIST, MNIST-M, SVHN, SynthDigits, USPS), `groups["domain"]`."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from fedrepro.data.base import DataMissingError, RawDataset
from fedrepro.data.dataset_registry import DatasetSpec, register_dataset
from fedrepro.registry import Param
from fedrepro.data.domains._common import (DIGIT_MEAN, DIGIT_STD, check_name_list, digit_labels, missing_error, stack_splits,
                                           evenly_spaced, to_rgb_chw)
from fedrepro.data.domains.fedbn_digits import (FEDBN_DIGITS_URL, FEDBN_HOW, fedbn_expected, prepare_fedbn_digits,
                                                fedbn_present, read_fedbn_digits)
from fedrepro.data.domains.mnistm import MNISTM_ORIG_DIR, mnistm_orig_present, prepare_mnistm, read_mnistm
from fedrepro.data.domains.syn import (SYN_ORIG_DIR, SYN_ORIG_FILES, prepare_syn, read_mat_splits, syn_orig_present,
                                       read_syn)


DIGIT5_DOMAINS = ("mnist", "mnistm", "svhn", "syn", "usps")
#: FedGCR's domain order for the Domain Imbalance Factor (utils/util.py prepare_digit_uneven,
#: decay_order); pass it as `domains` to get these domain ids.
FEDGCR_DIGIT5_ORDER = ("mnist", "usps", "syn", "mnistm", "svhn")
SVHN_DIR = "SVHN"
SVHN_FILES = ("train_32x32.mat", "test_32x32.mat")
USPS_DIR = "USPS"
USPS_FILES = ("usps.bz2", "usps.t.bz2")
MNIST_RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
DIGIT5_SOURCE = (
    "Digit-Five: MNIST (http://yann.lecun.com/exdb/mnist/ via torchvision.datasets.MNIST), "
    "SVHN (http://ufldl.stanford.edu/housenumbers/, torchvision.datasets.SVHN format), "
    "USPS (https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass.html#usps via torchvision.datasets.USPS), "
    f"MNIST-M and SynthDigits (see `mnistm`, `syn`); or all five from FedBN's release {FEDBN_DIGITS_URL}"
)


def _tv_missing(root: Path, domain: str) -> list[str]:
    root = Path(root)
    if domain == "mnist":
        return [f"MNIST/raw/{f}" for f in MNIST_RAW_FILES if not (root / "MNIST" / "raw" / f).is_file()]
    if domain == "svhn":
        return [f"{SVHN_DIR}/{f}" for f in SVHN_FILES if not (root / SVHN_DIR / f).is_file()]
    if domain == "usps":
        return [f"{USPS_DIR}/{f}" for f in USPS_FILES if not (root / USPS_DIR / f).is_file()]
    raise KeyError(domain)


def _read_tv_domain(root: Path, domain: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MNIST / SVHN / USPS with their official train/test splits: (NHW[C] uint8, labels, split)."""
    root = Path(root)
    if domain == "svhn":
        # A small private reader of the torchvision SVHN layout (torchvision's class insists on
        # the MD5 of the full files); same arrays: X (32,32,3,N), y with 10 meaning digit 0.
        return read_mat_splits(root / SVHN_DIR, SVHN_FILES)
    from torchvision import datasets as tvd

    pieces = []
    for split, train in ((0, True), (1, False)):
        try:
            if domain == "mnist":
                ds = tvd.MNIST(str(root), train=train, download=False)
                x, y = ds.data.numpy(), ds.targets.numpy()
            else:
                ds = tvd.USPS(str(root / USPS_DIR), train=train, download=False)
                x, y = np.asarray(ds.data), np.asarray(ds.targets)
        except (RuntimeError, OSError, ValueError, EOFError) as exc:
            raise DataMissingError(f"cannot read {domain.upper()} under {root}: {exc}") from None
        pieces.append((split, np.asarray(x, dtype=np.uint8), digit_labels(y, domain)))
    return stack_splits(pieces)


def _digit5_missing(root: Path, domains: Sequence[str], source: str) -> list[str]:
    root = Path(root)
    if source == "fedbn":
        return fedbn_expected(root, domains)
    out = []
    for d in domains:
        if d in ("mnist", "svhn", "usps"):
            out += _tv_missing(root, d)
        elif d == "mnistm" and not (fedbn_present(root, d) or mnistm_orig_present(root)):
            out += fedbn_expected(root, [d]) + [f"  (or the original MNIST-M folders in {MNISTM_ORIG_DIR}/)"]
        elif d == "syn" and not (fedbn_present(root, d) or syn_orig_present(root)):
            out += fedbn_expected(root, [d]) + [f"  (or {SYN_ORIG_DIR}/{SYN_ORIG_FILES[0]} and {SYN_ORIG_FILES[1]})"]
    return out


def _digit5_how(source: str) -> list[str]:
    if source == "fedbn":
        return FEDBN_HOW
    return [
        "run `fedrepro prepare` with internet access: torchvision downloads MNIST (into MNIST/raw), "
        f"SVHN ({SVHN_DIR}/, http://ufldl.stanford.edu/housenumbers/) and USPS ({USPS_DIR}/), and "
        "MNIST-M / SynthDigits come from FedBN's release (needs `pip install gdown`), or",
        "place the files by hand: MNIST IDX files (gunzipped) in MNIST/raw, SVHN's train_32x32.mat and test_32x32.mat "
        f"in {SVHN_DIR}/, USPS's usps.bz2 and usps.t.bz2 in {USPS_DIR}/, and MNIST-M / SynthDigits as described for the "
        f"`mnistm` / `syn` datasets ({FEDBN_DIGITS_URL})",
    ]


def _digit5_domains(params: dict) -> list[str]:
    return check_name_list("dataset 'digit5'", "domains", params["domains"], DIGIT5_DOMAINS)


def _prepare_digit5(root: Path, params: dict) -> None:
    root = Path(root)
    domains = _digit5_domains(params)
    if not _digit5_missing(root, domains, params["source"]):
        return
    if params["source"] == "fedbn":
        prepare_fedbn_digits(root, domains)
        return
    try:
        from torchvision import datasets as tvd

        for d in domains:
            if d in ("mnist", "svhn", "usps") and _tv_missing(root, d):
                for train in (True, False):
                    if d == "mnist":
                        tvd.MNIST(str(root), train=train, download=True)
                    elif d == "svhn":
                        tvd.SVHN(str(root / SVHN_DIR), split="train" if train else "test", download=True)
                    else:
                        tvd.USPS(str(root / USPS_DIR), train=train, download=True)
    except Exception as exc:
        raise missing_error("Digit-Five files are", root, _digit5_missing(root, domains, "torchvision"),
                            _digit5_how("torchvision"), f"{type(exc).__name__}: {exc}") from None
    if "mnistm" in domains:
        prepare_mnistm(root, {"layout": "auto"})
    if "syn" in domains:
        prepare_syn(root, {"layout": "auto"})


def _load_digit5(root: Path, params: dict) -> RawDataset:
    root = Path(root)
    domains = _digit5_domains(params)
    source, size, cap = params["source"], int(params["image_size"]), params["max_per_domain"]
    missing = _digit5_missing(root, domains, source)
    if missing:
        raise missing_error(f"Digit-Five files (source={source!r}) are", root, missing, _digit5_how(source))
    xs, ys, splits, dom = [], [], [], []
    used = []
    for i, d in enumerate(domains):
        if source == "fedbn":
            x, y, s = read_fedbn_digits(root, d)
            used.append(f"{d}: fedbn")
        elif d == "mnistm":
            x, y, s, layout = read_mnistm(root)
            used.append(f"mnistm: {layout}")
        elif d == "syn":
            x, y, s, layout = read_syn(root)
            used.append(f"syn: {layout}")
        else:
            x, y, s = _read_tv_domain(root, d)
            used.append(f"{d}: official")
        keep = np.concatenate([np.flatnonzero(s == k)[evenly_spaced(int((s == k).sum()), cap)] for k in (0, 1)])
        xs.append(to_rgb_chw(x[keep], size))
        ys.append(y[keep])
        splits.append(s[keep])
        dom.append(np.full(len(keep), i, dtype=np.int64))
    return RawDataset(
        name="digit5",
        x=np.concatenate(xs),
        y=np.concatenate(ys),
        num_classes=10,
        official_split=np.concatenate(splits),
        mean=DIGIT_MEAN,
        std=DIGIT_STD,
        source=f"{DIGIT5_SOURCE} [domains (id order): {', '.join(used)}]",
        groups={"domain": np.concatenate(dom)},
    )


register_dataset(
    DatasetSpec(
        name="digit5",
        summary="Digit-Five: MNIST, MNIST-M, SVHN, SynthDigits, USPS as 3xSxS RGB, 10 classes, domain id per sample",
        source=DIGIT5_SOURCE,
        num_classes=10,
        sample_shape=(3, 32, 32),
        size="official splits: ~70k + 68k + 99k + 489k + 9.3k images; FedBN release: 7,438 train per domain + 20 % test",
        params={
            "image_size": Param(32, "common side S of the 3xSxS images (PIL bilinear resize; FedGCR resizes to 224)", int, minimum=4),
            "source": Param(
                "torchvision",
                "'torchvision': MNIST/SVHN/USPS official splits read via torchvision's layouts, MNIST-M/SynthDigits as "
                "`mnistm`/`syn` (layout auto); 'fedbn': all five from FedBN's pre-processed release (FedBN/FedGCR's data)",
                str,
                choices=("torchvision", "fedbn"),
            ),
            "domains": Param(
                list(DIGIT5_DOMAINS),
                "the domains to include; groups['domain'] is the index in this list "
                f"(FedGCR's DIF order is {list(FEDGCR_DIGIT5_ORDER)})",
                (list, tuple),
            ),
            "max_per_domain": Param(
                None,
                "optional cap on the images of each (domain, official split); evenly spaced over file order; None = all",
                (int, type(None)),
                minimum=1,
            ),
        },
        prepare=_prepare_digit5,
        load=_load_digit5,
    )
)
