"""Multi-domain image datasets and the MIT-BIH ECG beats, registered in `DATASETS`.

One module per source (`mnistm`, `syn`, `digit5`, `pacs`, `domainnet`, `mitbih`, plus
`fedbn_digits` for FedBN's release and `_common` for shared helpers); importing this package
registers them all, and its namespace re-exports their public names.

Datasets (each `prepare` may download; each `load` is offline and raises
`DataMissingError` at once, naming the expected files, their folder and how to get
them):

* `mnistm`: MNIST-M, 3x28x28 RGB digits, 10 classes.
* `syn`: SynthDigits (Ganin's SynNumbers), 3x32x32 RGB digits, 10 classes.
* `digit5`: Digit-Five = MNIST, MNIST-M, SVHN, SynthDigits, USPS, all as 3 x S x S
  (S = `image_size`, default 32), `groups["domain"]` = index in the `domains` param.
* `pacs`: PACS, photo / art_painting / cartoon / sketch, 7 classes, `groups["domain"]`.
* `domainnet`: DomainNet, 6 domains, a class subset (default FedBN's / FedGCR's 10
  classes), `groups["domain"]`.
* `mitbih`: MIT-BIH Arrhythmia beats: one window of `window` samples (360 Hz) around
  each annotated beat, 12 beat classes (GRP-FED), x float32 (1, window),
  `groups["patient"]` (0..P-1) and `groups["record"]` (the MIT-BIH record number).

On-disk layout under the data root `root` (what `prepare` produces; the paths are
also module constants):

    root/fedbn_digits/{MNIST,SVHN,USPS,SynthDigits,MNIST_M}/partitions/train_part<k>.pkl
                                                           /test.pkl
        FedBN's pre-processed Digit-Five (`digit_dataset.zip`, med-air/FedBN README),
        exactly what FedBN and FedGCR train on. Each .pkl is a pickled
        (images uint8 (N,H,W[,3]), labels int (N,)) tuple. The `train_part<k>.pkl`
        files (k = 0..9, 743 or 744 images each) are FedBN's training pool (FedBN's
        `--percent p` reads the first 10p of them); `test.pkl` is the test split (20 %
        of the whole set, stratified). A `train.pkl` there is ignored.
    root/mnist_m/mnist_m_{train,test}/*.png + mnist_m_{train,test}_labels.txt
        the original MNIST-M release (`mnist_m.tar.gz`, lines "00000000.png 5").
    root/SynthDigits/synth_{train,test}_32x32.mat
        the original SynthDigits .mat files (X: 32x32x3xN uint8, y: N x 1), as in
        FedBN's raw `data.zip`.
    root/MNIST/raw/*-ubyte           torchvision.datasets.MNIST(root)
    root/SVHN/{train,test}_32x32.mat torchvision.datasets.SVHN(root / "SVHN") layout
    root/USPS/usps.bz2, usps.t.bz2   torchvision.datasets.USPS(root / "USPS")
    root/PACS/<domain>/<class>/*.jpg|png  (+ optional <domain>_{train,crossval}_kfold.txt)
    root/DomainNet/<domain>/<class>/*.jpg + root/DomainNet/<domain>_{train,test}.txt
    root/mitdb/<record>.{hea,dat,atr}    wfdb.dl_database("mitdb", root / "mitdb")

Normalisation (`RawDataset.mean/std`): the digit sets use FedBN's / FedGCR's
Normalize((0.5,)*3, (0.5,)*3); PACS and DomainNet use none (mean 0, std 1), as
FedGCR's `prepare_domainnet_uneven` (ToTensor only); MIT-BIH uses the loaded beats'
own mean / std (population).

Pickle note: FedBN's .pkl files are Python pickles (or .npy files holding a pickled object
array). They are read by a restricted unpickler that builds numpy arrays and nothing else
(`safe_unpickle`): a planted pickle that names any other Python object is refused, never run.

Downloads (`fedrepro prepare`) go through fedrepro.data.downloads: DomainNet's archives and
split files are verified against their published md5 and size before use; FedBN's
digit_dataset.zip, DomainBed's PACS.zip and the MIT-BIH records have no published checksum
and are downloaded only with FEDREPRO_ALLOW_UNPINNED_DOWNLOADS=1 (their sha256 is then
recorded in the dataset's provenance). Archives are unpacked into a temporary folder that is
renamed into place, and every path read from a list file (DomainNet's and MNIST-M's) must
stay inside its data folder.
"""

from __future__ import annotations

from fedrepro.data.domains._common import (DIGIT_MEAN, DIGIT_STD, NO_NORM_MEAN, NO_NORM_STD, evenly_spaced, read_images,
                                           to_rgb_chw)  # noqa: F401
from fedrepro.data.domains.fedbn_digits import (FEDBN_DIGITS_DIR, FEDBN_DIGITS_DOWNLOAD, FEDBN_DIGITS_GDRIVE_ID,
                                                FEDBN_DIGITS_URL, FEDBN_DIGITS_ZIP, FEDBN_DIGIT_FOLDERS, FEDBN_HOW,
                                                read_pkl_pair, fedbn_dir, fedbn_present, read_fedbn_digits,
                                                safe_unpickle)  # noqa: F401
from fedrepro.data.domains.mnistm import (LAYOUT_CHOICES, LAYOUT_PARAM, MNISTM_ORIG_DIR, MNISTM_ORIG_URL, MNISTM_SOURCE,
                                          read_mnistm, read_mnistm_original)  # noqa: F401
from fedrepro.data.domains.syn import (SYN_ORIG_DIR, SYN_ORIG_FILES, SYN_ORIG_URL, SYN_SOURCE, read_syn)  # noqa: F401
from fedrepro.data.domains.digit5 import (DIGIT5_DOMAINS, DIGIT5_SOURCE, FEDGCR_DIGIT5_ORDER, MNIST_RAW_FILES, SVHN_DIR,
                                          SVHN_FILES, USPS_DIR, USPS_FILES)  # noqa: F401
from fedrepro.data.domains.pacs import (PACS_CLASSES, PACS_DIR, PACS_DOMAINS, PACS_DOWNLOAD, PACS_GDRIVE_ID, PACS_HOW,
                                        PACS_SOURCE)  # noqa: F401
from fedrepro.data.domains.domainnet import (DOMAINNET_BASE_URL, DOMAINNET_DIR, DOMAINNET_DOMAINS, DOMAINNET_PINS,
                                             DOMAINNET_PIN_SOURCE, DOMAINNET_SOURCE, DOMAINNET_TXT_URL,
                                             DOMAINNET_ZIP_URLS, FEDBN_DOMAINNET_CLASSES, domainnet_download)  # noqa: F401
from fedrepro.data.domains.mitbih import (BEAT_SYMBOLS, MITBIH_CLASSES, MITBIH_SOURCE, MITDB_DIR, MITDB_FS,
                                          MITDB_RECORDS)  # noqa: F401
from fedrepro.data.domains import shifted  # noqa: F401  (registers shifted_domains)
