"""Reproducible pipeline that trains the embedded demo pair: a Llama target and a draft distilled from it."""
