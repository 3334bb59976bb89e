from trainingrun.cli import main

raise SystemExit(main())
