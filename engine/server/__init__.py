"""HTTP side of the engine: TGI-compatible and OpenAI-compatible routes on Starlette (see app.build_app)."""
