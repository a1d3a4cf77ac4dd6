"""cloudseg: full-resolution segmentation for Kaggle's "Understanding Clouds from Satellite Images"."""

import os

# albumentations asks the package index for its newest version when it is imported: up to 2 s and a
# warning on every command where there is no network (GPU clusters, Kaggle kernels). cloudseg reaches
# the network only when asked to (make data, cloudseg download); a user's own setting of this wins.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

__version__ = "0.1.0"
