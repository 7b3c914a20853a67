"""The verify service: scores drafts with the target model and runs the rejection sampler."""
