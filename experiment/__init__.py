"""coop's science: plans, tasks, corpus, seed model, training, evaluation, report."""
