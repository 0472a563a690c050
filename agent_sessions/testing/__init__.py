"""What an application's tests and a first try need beside the library: ``model_server``, a scripted
OpenAI-compatible model server (standard library only), so a run can be tried and tested without a model.
Nothing in the library imports this package."""
