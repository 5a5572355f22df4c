"""jobs: one module per user-facing job; each wires packages together, holding no domain logic.

    home       the home folder, the catalog, bundle and manifest look-ups jobs share
    config     the run config: each component's dataclass, composed; recipes under configs/
    tokenizer  train a tokenizer, evaluate a bundle on files, decode a committed sample
    ingest     tokenize files on the Ray Data pools into one catalog snapshot
    catalog    list, show, history, stats, tag, query, verify, gc
    train      train the unified model on a snapshot, evaluate it, export a sub-model
    demo       the whole path on sample data

The command line (`tokenloom.cli`) is a thin shell over these; Python users call them directly,
e.g. `from tokenloom.jobs import demo, home, config`.
"""
