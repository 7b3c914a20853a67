"""The accelerator twin: a model backend whose passes take the modelled time of a GPU deployment (a roofline of the
profile's hardware) and whose logits come from a deterministic synthetic target and a draft calibrated to a set
acceptance rate, chosen at start-up with `--device sim:PROFILE` (docs/architecture.md, "The accelerator twin")."""
