"""The model zoo: architectures no one here wrote, lowered, saved, loaded in a fresh process and compared with eager."""
