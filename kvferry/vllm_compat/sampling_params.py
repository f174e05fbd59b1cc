"""``SamplingParams``: kvferry's own class."""

from kvferry.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
