"""tpugen: text-to-image generation on Cloud TPU VMs through torch_xla."""

__version__ = "0.1.0"
