from poslens.cli import main

raise SystemExit(main())
