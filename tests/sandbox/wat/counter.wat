;; State isolation: bump a mutable global and a memory cell; exit 3 if either was
;; already non-zero (i.e. a previous run's instance leaked into this one).
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (global $g (mut i32) (i32.const 0))
  (func (export "_start")
    (if (i32.or (global.get $g) (i32.load (i32.const 0)))
      (then (call $proc_exit (i32.const 3))))
    (global.set $g (i32.const 1))
    (i32.store (i32.const 0) (i32.const 1))))
