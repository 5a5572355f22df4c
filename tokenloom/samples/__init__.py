"""samples: generators of sample and broken data for the demo, the tests and the benchmarks.

Everything is made offline from what the machine already has: docstrings of Python's standard
library (`text`), the photographs scikit-image ships (`images`), speech from eSpeak NG and
synthetic sounds (`audio`), each beside deliberately odd and broken files of its modality, so
that every job shows its quarantine. Only `jobs/demo`, the tests and `bench/` import this
package: no job that users run on their own data depends on it.
"""
