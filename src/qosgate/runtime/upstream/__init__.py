"""A replica behind HTTP: an OpenAI-compatible engine (vLLM, SGLang, a stand-in) as an
``Engine`` port."""
