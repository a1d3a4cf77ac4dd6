"""cloudseg: full-resolution segmentation for Kaggle's "Understanding Clouds from Satellite Images"."""

__version__ = "0.1.0"
