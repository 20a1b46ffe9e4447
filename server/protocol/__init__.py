"""The experiment's protocol: what each job kind is and records, the phases and their order, the serving
rules of the pair, the reactions to ended attempts, and the operator's actions."""
