"""The gateway's chat API that turns requests into prompt events; batch submission."""
