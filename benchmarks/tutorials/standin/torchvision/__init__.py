"""A stand-in ``torchvision`` for running DeepSpeed's CIFAR-10 tutorial offline and reproducibly.

Put ``benchmarks/tutorials/standin`` first on ``PYTHONPATH`` and ``import torchvision`` finds this
package instead of the real one (which is not installed here, and whose ``CIFAR10`` downloads 170 MB).
It provides what ``training/cifar/cifar10_deepspeed.py`` uses, and nothing else:

- ``torchvision.datasets.CIFAR10``: a synthetic, learnable set of 32x32x3 uint8 images in 10 classes,
  the same for every run, process and library (``datasets.py``);
- ``torchvision.transforms.Compose``, ``ToTensor``, ``Normalize`` (``transforms.py``).

Settings (environment variables, read when a dataset is built):

- ``CIFAR_STANDIN_TRAIN_SIZE`` (default 8000), ``CIFAR_STANDIN_TEST_SIZE`` (default 1000): images per
  split (the test size must be a multiple of the tutorial's test batch of 4);
- ``CIFAR_STANDIN_SEED`` (default 0): the data, and torch's global generator. The tutorial sets no
  seed, so each run would start from other initial weights; building a dataset seeds torch's global
  generator with this value (the tutorial builds its datasets just before its network), so every run,
  library and ZeRO stage starts from the same weights.
- ``CIFAR_STANDIN_TORCH_SEED`` (default: ``CIFAR_STANDIN_SEED``): torch's global generator alone (the initial
  weights, the loader's shuffle, the gate's random draws), the data unchanged: runs that differ only in
  their random stream, to measure a training run's own spread.
"""
from torchvision import datasets, transforms

__version__ = "0.0.0+deepshard.standin"
__all__ = ["datasets", "transforms"]
