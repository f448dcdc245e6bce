"""OpenAI wire format, pure: request parsing, responses, splicing, engine metrics, the one error
body and SSE framing. No asyncio, no sockets: bytes in, values and bytes out."""
