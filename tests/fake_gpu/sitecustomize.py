"""Python runs this at the start of every process that the tests start on a machine without a GPU
(tests/conftest.py puts this folder on PYTHONPATH and names the card in CLOUDSEG_FAKE_GPU): once
the process imports torch, code outside torch sees that GPU, as the tests' own process does
(tests/fake_cuda.py, `present_to_all_but_torch`). A process that never imports torch pays nothing."""

import importlib.abc
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class AfterTorch(importlib.abc.MetaPathFinder):
    """Finds torch as the other finders do, and installs the fake once torch has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            sys.path.insert(0, ROOT)
            try:
                from tests.fake_cuda import present_to_all_but_torch
            finally:
                sys.path.remove(ROOT)
            present_to_all_but_torch(os.environ["CLOUDSEG_FAKE_GPU"])

        spec.loader.exec_module = exec_module
        return spec


# CUDA_VISIBLE_DEVICES="" hides every GPU from torch: the fake one too.
if os.environ.get("CLOUDSEG_FAKE_GPU", "none") != "none" and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    sys.meta_path.insert(0, AfterTorch())
