"""The OpenAI chat rules shared by the engine server (`engine/server/chat.py`) and the agent proxy
(`workflows/proxy.py`): request checks and sampling (`request`), tool calls, image content parts
(`images`, `vision_prompt`), the chat template on token ids (`template`) and JSON bodies (`http_body`)."""
