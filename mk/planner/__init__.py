"""The planner: op DAG, shared-memory and cost models, search, lowering."""
