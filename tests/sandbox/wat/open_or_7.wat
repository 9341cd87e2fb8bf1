;; Reference assertion (b): open "data/hello.txt" through the first preopen (fd 3);
;; if path_open fails, proc_exit(7), else exit 0. Without a preopen fd 3 does not exist.
(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "hello.txt")
  (func (export "_start")
    ;; dirfd=3, lookupflags=0, path=64, len=9, oflags=0, rights=fd_read(2), inheriting=0,
    ;; fdflags=0, out fd at 128.
    (if (call $path_open (i32.const 3) (i32.const 0) (i32.const 64) (i32.const 9)
                         (i32.const 0) (i64.const 2) (i64.const 0) (i32.const 0)
                         (i32.const 128))
      (then (call $proc_exit (i32.const 7))))))
