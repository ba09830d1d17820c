import os

from hypothesis import HealthCheck, settings

# "ci" (the default): derandomized, so every run tries the same examples.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# "dev": random exploration with more examples (HYPOTHESIS_PROFILE=dev).
settings.register_profile("dev", deadline=None, max_examples=500,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tests make many small kernel calls: one intra-op thread is faster and
# repeatable on the 2-core CI machine (80 s vs 7 s for test_kernels under load).
try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass
