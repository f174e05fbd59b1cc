"""The OpenAI-compatible server: protocol (request bodies), serving (handlers), api_server."""
