"""One benchmark per engine: rollout (sampler) and learner train step."""
