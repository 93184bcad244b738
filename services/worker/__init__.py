"""The worker base every prefill and decode worker builds on."""
