"""Request shaping: the tokenizer and chat template with Gemma's markup (tokenizer.py), tool calls (tool_calls.py),
the grammar of structured output (grammar.py) and its compile pool (grammar_pool.py). It imports only the runtime
contract (serving/engine.py)."""
