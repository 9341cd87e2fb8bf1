;; Reports, as its exit code, what it finds left by an earlier instance, then leaves
;; state behind for a later one: 1 = byte 0 of memory is set, 2 = the mutable global is
;; set, 4 = the data segment's byte at 16 is not its initial 7, 8 = memory is over its
;; initial page. Then it sets byte 0 and the global, clears byte 16, grows memory by one
;; page, counts to 100 (fuel is checked at loop heads) and exits with the sum (0 on a
;; fresh instance).
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "\07")
  (global $g (mut i32) (i32.const 0))
  (func (export "_start")
    (local $seen i32)
    (local $i i32)
    (if (i32.load8_u (i32.const 0))
      (then (local.set $seen (i32.or (local.get $seen) (i32.const 1)))))
    (if (global.get $g)
      (then (local.set $seen (i32.or (local.get $seen) (i32.const 2)))))
    (if (i32.ne (i32.load8_u (i32.const 16)) (i32.const 7))
      (then (local.set $seen (i32.or (local.get $seen) (i32.const 4)))))
    (if (i32.gt_u (memory.size) (i32.const 1))
      (then (local.set $seen (i32.or (local.get $seen) (i32.const 8)))))
    (i32.store8 (i32.const 0) (i32.const 1))
    (global.set $g (i32.const 1))
    (i32.store8 (i32.const 16) (i32.const 0))
    (drop (memory.grow (i32.const 1)))
    (loop $count
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $count (i32.lt_u (local.get $i) (i32.const 100))))
    (call $exit (local.get $seen))))
