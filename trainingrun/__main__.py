from trainingrun.cli import main

# Guarded: Megatron's checkpoint writer starts a helper process with the "spawn" method, which imports this module
# again (as __mp_main__); it must not run the command a second time.
if __name__ == "__main__":
    raise SystemExit(main())
