"""``python -m btbctl`` entry point."""

from btbctl.commands.app import main

if __name__ == "__main__":
    main()
