"""An OpenAI-compatible endpoint in front of the rollout service, recording token-exact trajectories
(docs/openai.md): app.py the FastAPI app, schemas.py request checking, templates.py chat templates,
sessions.py the session store (shared_sessions.py: in a Ray actor, for an endpoint in front of a Ray service),
calls.py one call's work, responses.py the response shapes, trajectories.py the learner's view, auth.py the
bearer token, server.py uvicorn, replicas.py Ray Serve replicas (imported on its own: it needs Ray)."""
from rollout_service.openai.app import openai_app
from rollout_service.openai.schemas import Limits
from rollout_service.openai.server import OpenAIServer, serve_openai
from rollout_service.openai.trajectories import release, set_reward, trajectories

__all__ = ["Limits", "OpenAIServer", "openai_app", "release", "serve_openai", "set_reward", "trajectories"]
