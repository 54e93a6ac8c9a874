"""Integrations with the trainers people already use.

Each submodule imports its framework (``transformers``, ``lightning``,
``deepspeed``) when it is imported itself, never before: ``import
datastates_hist`` loads none of them. Install one with its extra,
``pip install "datastates-hist[hf]"`` or ``"datastates-hist[lightning]"``.
"""
