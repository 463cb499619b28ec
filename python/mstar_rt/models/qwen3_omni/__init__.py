"""Qwen3-Omni (thinker -> talker + code predictor -> code2wav) on the runtime."""
