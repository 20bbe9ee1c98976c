"""The engine server (`server.py`): an engine behind HTTP with SGLang's native routes and OpenAI chat
(`chat.py`); what its bodies and answers hold (`wire.py`). `python -m flowrl_operators.engine.server
--model PATH` runs it."""
