"""An OpenEnv environment as rlhf_paro's env.function (README, "Environments from OpenEnv").

    pip install -e ".[openenv]"
    python -m rlhf_paro.train ... env.function=examples/openenv_echo_env.py:EchoEnv env.reward=env

The first part is an OpenEnv environment written as the library's environments are: an echo
game (each message comes back; a message earns 0.1 a word; the third one ends the episode). A
real one is imported from its package, or runs elsewhere and is reached by its server's
address: this one too, started with
``uvicorn --app-dir examples openenv_echo_env:app --host 127.0.0.1 --port 8000`` and then
``ECHO_ENV_URL=http://127.0.0.1:8000``. The last part, ``EchoEnv``, is all the wrapping a run
needs; without ECHO_ENV_URL each actor process serves the environment itself.
"""

import os

# First: without the openenv extra, this line says which extra to install.
from rlhf_paro.envs.openenv import OpenEnv

from openenv.core import Action, Environment, Observation, State, create_fastapi_app


# --- the environment, as an OpenEnv environment's package ships it --------------------------------

class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed: str = ""


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session builds its own instance
    STEPS = 3

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id)
        return EchoObservation()

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        return EchoObservation(echoed=action.message, reward=0.1 * len(action.message.split()),
                               done=self._state.step_count >= self.STEPS)

    @property
    def state(self):
        return self._state


app = create_fastapi_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=256)


# --- the wrapping: one sample's episode as a session of it ----------------------------------------

class EchoEnv(OpenEnv):
    url = os.environ.get("ECHO_ENV_URL")  # None: served in this process
    served = (EchoEnvironment, EchoAction, EchoObservation)

    def action(self, text):
        return {"message": text}

    def observation(self, observation):
        return observation["echoed"] or None  # the reset's empty echo: the prompt starts alone
