"""``torchdelegate llm serve``: OpenAI's HTTP API over a program ``llm export`` wrote, its requests
run by worker processes that share one copy of the weights."""
