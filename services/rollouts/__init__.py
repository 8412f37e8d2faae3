"""The rollout runner: replay tasks rolled out in sandboxes through the relay, grouped, rewarded, published."""
