/**
 * `agent-vault validator`: the local chain alone, served over HTTP, until SIGINT/SIGTERM.
 */
import { OffsetClock } from '../clock/clock.ts';
import { startRpcServer, type RpcServer } from './http.ts';
import { LocalValidator } from './validator.ts';

export interface ValidatorCommandOptions {
  port: number;
  dataDir?: string;
  slotMs?: number;
  host?: string;
  programSoPath?: string | null;
  /** Whether to exit the process on SIGINT/SIGTERM (default true). */
  handleSignals?: boolean;
}

export interface RunningValidator {
  validator: LocalValidator;
  rpc: RpcServer;
  /** Stops serving, executes what is queued, persists and releases the state. */
  close(): Promise<void>;
}

function logLine(entry: Record<string, unknown>): void {
  process.stdout.write(`${JSON.stringify({ time: new Date().toISOString(), ...entry })}\n`);
}

export async function runValidatorCommand(options: ValidatorCommandOptions): Promise<RunningValidator> {
  const clock = new OffsetClock();
  const validator = await LocalValidator.open({
    dataDir: options.dataDir, slotMs: options.slotMs, clock, programSoPath: options.programSoPath, log: logLine,
  });
  // Standalone, this process owns the clock: agentVault_setTime moves may have put the chain's
  // clock ahead of the wall before a restart, and it must not go back.
  clock.setAtLeast(validator.clockUnixTimestamp * 1000);
  let rpc: RpcServer;
  try {
    rpc = await startRpcServer(validator, { port: options.port, host: options.host, log: logLine });
  } catch (error) {
    await validator.close();
    throw error;
  }
  const info = validator.info();
  logLine({
    level: 'info', msg: 'local validator ready', url: rpc.url, programId: info.programId, usdcMint: info.usdcMint,
    programDeployed: info.programDeployed, slotMs: info.slotMs, dataDir: options.dataDir ?? null,
  });

  let closing: Promise<void> | null = null;
  const close = (): Promise<void> => {
    closing ??= (async () => {
      await rpc.close();
      await validator.close();
      logLine({ level: 'info', msg: 'local validator stopped' });
    })();
    return closing;
  };
  if (options.handleSignals ?? true) {
    const onSignal = (signal: NodeJS.Signals): void => {
      logLine({ level: 'info', msg: 'shutting down', signal });
      close().then(() => process.exit(0), (error: unknown) => {
        logLine({ level: 'error', msg: 'shutdown failed', err: String(error) });
        process.exit(1);
      });
    };
    // `on`: a second signal waits for the same close (`closing`), not the default's immediate end.
    process.on('SIGINT', onSignal);
    process.on('SIGTERM', onSignal);
  }
  return { validator, rpc, close };
}
