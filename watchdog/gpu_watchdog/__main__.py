from gpu_watchdog.cli import main

raise SystemExit(main())
